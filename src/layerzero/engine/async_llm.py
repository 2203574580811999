"""``AsyncLLM``: the online engine (vLLM V1's name and API). Requests come and go while steps run; the engine
core (scheduler, model, KV cache) runs in its own process, so the front end's work (tokenizing, detokenizing,
HTTP) never holds the GIL the steps need.

Message flow (one asyncio loop in this process; :mod:`.core.core_client` and :mod:`.core.core_proc`)::

    generate(): validate -> OutputProcessor.add_request -> EngineCoreRequest --zmq--> core: joins the batch
    core: step -> EngineCoreOutputs (one msgpack message per step) --zmq--> loop reader callback ->
        OutputProcessor.process_outputs (detokenize, stop strings) -> each request's stream (a one-slot
        collector that merges deltas a slow consumer has not taken yet) + the stop-string aborts -> core
    abort() / a consumer that leaves: OutputProcessor.abort_request + EngineCoreAbort -> core
    core dies: every open stream raises EngineDeadError
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

from .config import EngineConfig, ModelConfig, resolve_device
from .core.errors import EngineDeadError
from .core.messages import EngineCoreAbort, EngineCoreOutputs, SchedulerStats
from .errors import bad_config, bad_input
from .frontend.dp_router import DPRouter
from .frontend.input_processor import InputProcessor
from .frontend.output_processor import OutputProcessor
from .loader import load_tokenizer
from .outputs import RequestOutput
from .sampling_params import SamplingParams

__all__ = ["AsyncLLM", "EngineDeadError"]


class _Stream:
    """One request's outputs on their way to its ``generate`` consumer: one slot; a delta that arrives while
    the previous one was not taken yet is merged into it (so a slow consumer costs no memory growth and no
    extra wake-ups), then an error, if any, after every output."""

    __slots__ = ("core_id", "error", "out", "ready")

    def __init__(self, core_id: str) -> None:
        self.core_id = core_id  # the request's id in the core and the output processor
        self.out: RequestOutput | None = None
        self.error: BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, out: RequestOutput) -> None:
        self.out = out if self.out is None else _merge(self.out, out)
        self.ready.set()

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
            self.ready.set()

    async def get(self) -> RequestOutput:
        if self.out is None and self.error is None:
            await self.ready.wait()
        self.ready.clear()
        out, self.out = self.out, None
        if out is not None:
            if self.error is not None:
                self.ready.set()  # the error comes next
            return out
        raise self.error  # type: ignore[misc]


def _merge(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Delta ``a`` followed by delta ``b`` as one delta (per completion index: text, token ids and logprobs
    concatenated; the rest from ``b``)."""
    outs = {c.index: c for c in a.outputs}
    for c in b.outputs:
        p = outs.get(c.index)
        if p is None:
            outs[c.index] = c
            continue
        logprobs = (
            p.logprobs + c.logprobs if p.logprobs is not None and c.logprobs is not None else c.logprobs
        )
        outs[c.index] = dataclasses.replace(
            c, text=p.text + c.text, token_ids=p.token_ids + c.token_ids, logprobs=logprobs
        )
    merged = {f.name: getattr(b, f.name) for f in dataclasses.fields(b)}
    for name, value in merged.items():  # fields sent once (prompt logprobs, ...) keep their first value
        if value is None and getattr(a, name) is not None:
            merged[name] = getattr(a, name)
    merged["outputs"] = sorted(outs.values(), key=lambda c: c.index)
    return RequestOutput(**merged)


def replica_configs(config: EngineConfig) -> list[tuple[EngineConfig, str | None]]:
    """Each data-parallel replica's engine config (``data_parallel_size`` 1) and its core process's
    ``CUDA_VISIBLE_DEVICES``: replica r gets the r-th group of ``tensor_parallel_size`` visible GPUs (None
    without data parallelism, or on the CPU: inherited)."""
    dp, tp = config.data_parallel_size, config.tensor_parallel_size
    if dp == 1:
        return [(config, None)]
    rc = dataclasses.replace(config, data_parallel_size=1)
    if resolve_device(config.device).type != "cuda":
        return [(rc, None)] * dp
    import os

    import torch

    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = [d.strip() for d in env.split(",") if d.strip()] if env else None
    visible = visible or [str(i) for i in range(torch.cuda.device_count())]
    return [(rc, ",".join(visible[r * tp : (r + 1) * tp])) for r in range(dp)]


def sum_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """The replicas' stats as one engine's: counts summed, KV usage their mean (replicas have equal pools)."""
    out = SchedulerStats()
    for f in dataclasses.fields(SchedulerStats):
        vals = [getattr(s, f.name) for s in stats]
        if vals and isinstance(vals[0], list):  # per-position counts: summed position by position
            setattr(out, f.name, [sum(x) for x in zip(*vals, strict=False)])
            continue
        setattr(out, f.name, sum(vals) / len(vals) if f.name == "kv_cache_usage" else sum(vals))
    return out


class AsyncLLM:
    """The online engine: ``async for out in engine.generate(prompt, params, request_id)`` streams
    :class:`RequestOutput` deltas while other requests come and go (continuous batching); the engine core
    runs in a child process (spawned: a script that builds an engine at import time needs
    ``if __name__ == "__main__":``).

    Args:
        model: a Hugging Face checkpoint directory. ``**options``: every option of
            :class:`~layerzero.engine.LLM` (the same :class:`EngineConfig`, validated the same way).

    Use it from one asyncio event loop (it may move to a new loop once the previous one is closed), and end it
    with :meth:`shutdown` or ``async with`` / ``with``; it is also stopped when collected and at interpreter
    exit.

    Raises:
        ConfigurationError: a bad option, an unsupported checkpoint (as ``LLM``), also when the core process
            finds it. EngineCoreError: the core process failed to start for another reason.
    """

    def __init__(
        self,
        model: str | Path,
        *,
        _core_factory: str | None = None,
        _attach: list[dict[str, Any]] | None = None,
        **options: Any,
    ) -> None:
        from .core.core_client import MPClient

        self.config = config = EngineConfig(str(model), **options)
        local = [p for p in config.logits_processors if not isinstance(p, str)]
        if local:  # the config crosses to the core process by value: classes go by their import name
            raise bad_config(
                "AsyncLLM logits_processors",
                "classes importable by 'module:Class' (the engine core runs in another process)",
                repr(local),
                "Define the processor at a module's top level (not in a function or __main__).",
            )
        self.model_config = ModelConfig.from_pretrained(config.model)
        self._streams: dict[str, _Stream] = {}  # by the caller's request id
        self._core_ids: dict[str, str] = {}  # core id -> the caller's request id
        self._next_id = itertools.count()
        dp = config.data_parallel_size
        self._replica_stats = [SchedulerStats() for _ in range(dp)]
        self._stats = SchedulerStats()
        self._clients: list[Any] = []
        #: Which replica serves each request (data parallel; one replica: always 0).
        self.router = DPRouter(dp, config.block_size)
        try:
            for r, (rc, devices) in enumerate(replica_configs(config)):
                self._clients.append(
                    MPClient(
                        rc,
                        core_factory=_core_factory,
                        on_outputs=functools.partial(self._on_outputs, r),
                        on_dead=functools.partial(self._on_dead, r),
                        visible_devices=devices,
                        name="LayerZeroEngineCore" if dp == 1 else f"LayerZeroEngineCore-DP{r}",
                        attach=None if _attach is None else _attach[r],
                    )
                )
            # the tokenizer loads while the core processes start
            self.tokenizer = load_tokenizer(config.model)
            infos = [c.wait_ready() for c in self._clients]
            self.max_model_len: int = min(
                i.get("max_model_len") or (config.max_model_len or self.model_config.max_position_embeddings)
                for i in infos
            )
            self.num_kv_blocks: int | None = infos[0].get("num_kv_blocks")
            self.input_processor = InputProcessor.from_config(config, self.tokenizer, self.model_config)
            self.input_processor.max_model_len = self.max_model_len  # the cores' word is final
            self.output_processor = OutputProcessor(self.tokenizer)
        except BaseException:
            for c in self._clients:
                c.shutdown()
            raise

    @property
    def _client(self) -> Any:
        """The first replica's client (the only one without data parallelism): kernel reports and dispatch
        counters come from it."""
        return self._clients[0] if self._clients else None

    # ------------------------------------------------------------------------------------------ state
    @property
    def is_running(self) -> bool:
        """Whether the engine takes requests (started, no replica dead, not shut down)."""
        return bool(self._clients) and all(not c.errored and c.dead_error is None for c in self._clients)

    @property
    def errored(self) -> bool:
        """Whether an engine core (any replica's) died or failed (not by :meth:`shutdown`); ``/health`` turns
        503."""
        return any(c.errored for c in self._clients)

    @property
    def dead_error(self) -> BaseException:
        """Why the engine is dead (an :class:`EngineDeadError`; a generic one while it runs: vLLM's API)."""
        err = next((c.dead_error for c in self._clients if c.dead_error is not None), None)
        return err if err is not None else EngineDeadError("the engine core is not running")

    @property
    def num_running(self) -> int:
        """Requests running in the core at its last step."""
        return self._stats.num_running_reqs

    @property
    def num_waiting(self) -> int:
        """Requests waiting in the core at its last step."""
        return self._stats.num_waiting_reqs

    @property
    def stats(self) -> SchedulerStats:
        """The core's stats after its last step (no round trip; :meth:`get_stats` asks the core now); with
        data parallelism the replicas' summed (KV usage: their mean)."""
        return self._stats

    # --------------------------------------------------------------------------------------- requests
    def validate(
        self, prompt: str | list[int], params: SamplingParams, priority: int = 0
    ) -> tuple[str | None, list[int]]:
        """Every check of one request, nothing queued: (prompt text or None, prompt token ids).

        Raises:
            InvalidInputError: a bad prompt (empty, ids outside the vocabulary, longer than
                ``max_model_len``, text without a tokenizer) or bad parameters for this model.
        """
        return self.input_processor.validate(prompt, params, priority)

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None,
        request_id: str,
        *,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request: :class:`RequestOutput` deltas (each :class:`CompletionOutput` holds only the
        text, token ids and logprobs new since the previous one), the last with ``finished`` True. The
        request joins the running batch at the core's next step. Leaving the loop early (``break``, an
        exception, the task cancelled, the generator closed) aborts it and frees its KV blocks; an
        :meth:`abort` from elsewhere ends the stream with ``finish_reason="abort"``.

        Raises:
            InvalidInputError: bad input (see :meth:`validate`), a ``request_id`` that is not a non-empty
                string or is already in flight; raised before anything is queued.
            EngineDeadError: the engine core is gone (before or while streaming).
        """
        loop = asyncio.get_running_loop()
        for c in self._clients:
            c.bind(loop)  # raises EngineDeadError when a core is gone
        if not isinstance(request_id, str) or not request_id:
            raise bad_input("request_id", "a non-empty string", repr(request_id))
        if request_id in self._streams:
            raise bad_input("request_id", "an id not in flight", repr(request_id))
        params = sampling_params if sampling_params is not None else SamplingParams()
        # the core knows the request by a unique id: an id reused once its request ended can never get
        # the old request's late outputs (e.g. the core's last output after an abort)
        core_id = f"{request_id}#{next(self._next_id)}"
        text, request = self.input_processor.process(core_id, prompt, params, priority)
        client = self._clients[self.router.pick(core_id, request.prompt_token_ids)]
        stream = self._streams[request_id] = _Stream(core_id)
        self._core_ids[core_id] = request_id
        self.output_processor.add_request(
            core_id, text, request.prompt_token_ids, params, output_kind="delta"
        )
        finished = False
        try:
            client.add_request(request)
            while not finished:
                out = await stream.get()
                finished = out.finished
                yield out
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            self._core_ids.pop(core_id, None)
            self.router.finished(core_id)
            if not finished:  # left early or failed: forget it here and in the core
                self.output_processor.abort_request(core_id)
                if client.dead_error is None:
                    client.abort_requests([EngineCoreAbort(core_id)])

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """End requests by id: each stream ends with a last output (``finish_reason="abort"``) and the core
        frees their blocks at its next step. Unknown or finished ids are ignored.

        Raises:
            EngineDeadError: the engine core is gone.
        """
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        loop = asyncio.get_running_loop()
        for c in self._clients:
            c.bind(loop)
        self._abort(ids)

    def _abort(self, ids: list[str]) -> None:
        aborts: list[list[EngineCoreAbort]] = [[] for _ in self._clients]
        for rid in ids:
            stream = self._streams.get(rid)
            if stream is None:
                continue
            out = self.output_processor.abort_request(stream.core_id)
            if out is not None:
                out.request_id = rid
                stream.put(out)
            aborts[self.router.replica_of(stream.core_id) or 0].append(EngineCoreAbort(stream.core_id))
        for client, batch in zip(self._clients, aborts, strict=True):
            if batch:
                client.abort_requests(batch)

    async def get_stats(self) -> SchedulerStats:
        """The core's stats now (a round trip between two steps).

        Raises:
            EngineDeadError: the engine core is gone.
        """
        self._replica_stats = [await c.call_utility("get_stats") for c in self._clients]
        self._stats = sum_stats(self._replica_stats)
        return self._stats

    async def kernel_report(self) -> dict[str, Any]:
        """For every op the served model ran: the kernel serving each shape bucket and why (LayerZero's
        reports, from the core process; the first replica's with data parallelism).

        Raises:
            EngineDeadError: the engine core is gone.
        """
        return await self._client.call_utility("kernel_report")

    def enable_dispatch_counters(self, sample_every: int = 64) -> None:
        """Turn on LayerZero's dispatch counters (``layerzero.telemetry``) in the core process, where the
        kernels run; effective before any request sent after this call (no round trip).

        Raises:
            EngineDeadError: the engine core is gone.
        """
        self._client.call_utility_nowait("enable_dispatch_counters", int(sample_every))

    async def dispatch_counters(self) -> dict[str, Any]:
        """The core process's dispatch counters as plain data (``enabled`` plus
        ``layerzero.telemetry.snapshot()``'s fields).

        Raises:
            EngineDeadError: the engine core is gone.
        """
        return await self._client.call_utility("dispatch_counters")

    async def reset_prefix_cache(self) -> Any:
        """Drop the cores' prefix caches (blocks held by running requests stay); returns the first
        replica's answer."""
        answers = [await c.call_utility("reset_prefix_cache") for c in self._clients]
        return answers[0]

    # ------------------------------------------------------------------------------- the core's messages
    def _on_outputs(self, replica: int, outs: EngineCoreOutputs) -> None:
        """One step's outputs of ``replica``'s core (called by its client's reader on the loop): all requests
        at once, then the stop-string aborts to that core in the same call."""
        if outs.stats is not None:
            if len(self._clients) == 1:
                self._stats = outs.stats
            else:
                self._replica_stats[replica] = outs.stats
                self._stats = sum_stats(self._replica_stats)
        if not outs.outputs:
            return
        processed = self.output_processor.process_outputs(outs.outputs, outs.timestamp)
        streams, core_ids = self._streams, self._core_ids
        for out in processed.request_outputs:
            rid = core_ids.get(out.request_id)
            stream = streams.get(rid) if rid is not None else None
            if stream is not None and stream.core_id == out.request_id:
                out.request_id = rid
                stream.put(out)
        if processed.aborts:
            self._clients[replica].abort_requests(processed.aborts)

    def _on_dead(self, replica: int, error: EngineDeadError) -> None:
        """``replica``'s core died: its requests' streams raise ``error`` (the other replicas' go on; the
        engine reports itself errored, so ``/health`` turns 503)."""
        for stream in self._streams.values():
            if (self.router.replica_of(stream.core_id) or 0) == replica:
                stream.fail(error)

    # ------------------------------------------------------------------------------------------- the end
    def shutdown(self) -> None:
        """Stop the engine core process and free its sockets; open streams raise :class:`EngineDeadError`.
        Idempotent."""
        for c in self._clients:
            c.shutdown()

    def __enter__(self) -> AsyncLLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.shutdown()
