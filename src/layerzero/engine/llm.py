"""``LLM``: the offline entry point (vLLM's API): ``generate``, ``stream``, ``chat``, ``stats``."""

from __future__ import annotations

import collections
import gc
import itertools
import numbers
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import EngineConfig
from .core.engine_core import EngineCore
from .core.messages import EngineCoreAbort, EngineCoreRequest
from .errors import bad_config, bad_input
from .frontend.input_processor import InputProcessor, conversations
from .frontend.output_processor import OutputKind, OutputProcessor
from .loader import load_tokenizer
from .outputs import RequestOutput, merge_deltas
from .sampling_params import SamplingParams
from .spec_decode.config import SpeculativeConfig

__all__ = ["LLM"]


class LLM:
    """A language model served by LayerZero's engine (paged KV cache, prefix caching, continuous batching with
    chunked prefill; every attention / norm / RoPE / activation / sampling call is an ``lz.*`` op).

    Args:
        model: a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files).
        dtype: torch.float32 / float16 / bfloat16; None: bfloat16 (or the checkpoint's half dtype) on CUDA,
            float32 on CPU. device: ``"cuda"``, ``"cpu"``, ...; None: CUDA when available.
        max_model_len: tokens per sequence (prompt + output); None: the model's max_position_embeddings.
        max_num_seqs: sequences running at once. max_num_batched_tokens: tokens per step (the chunked-prefill
            budget); None: 8192.
        block_size: tokens per KV block. num_kv_blocks: KV pool size in blocks; None: from free device memory
            x ``kv_cache_memory_fraction`` on CUDA, ``cpu_kv_cache_bytes`` (1 GiB) on CPU, capped at what
            ``max_num_seqs`` full-length sequences need.
        enable_prefix_caching: reuse the KV of full blocks shared by prompts; ``prefix_cache``: ``"radix"`` (a
            radix tree, SGLang) or ``"hash"`` (chained block hashes, vLLM).
        scheduling_policy: ``"fcfs"``, ``"lpm"`` (longest prefix match with aging; requests sharing their
            first block admitted together) or ``"priority"``.
        enforce_eager: no CUDA graphs. seed: the engine's random stream (requests without their own seed).
        quantization: None, ``"int8"``, ``"int4"`` or ``"fp8"``: weight-only quantization of the decoder
            linears (QKV, o_proj, gate/up, down_proj; not the embedding, norms, LM head or MoE experts) at
            load time; int8 / fp8 e4m3 per output channel, int4 in groups of 128 along in_features;
            ``"fp8_w8a8"``: the weights as ``"fp8"`` and the activations quantized to e4m3 per token on the
            fly, one fp8 GEMM (``lz.fp8_linear``; vLLM's fp8) (docs/engine.md).
        kv_cache_dtype: ``"auto"`` (the model's dtype), ``"fp8"`` (float8 e4m3) or ``"int8"``: the KV pool's
            dtype (vLLM's option); a quantized pool holds 1 byte per element, so the same memory holds 2x
            (bf16) or 4x (fp32) the blocks. Per-layer scales: the checkpoint's ``k_scale`` / ``v_scale`` when
            present, else 1.0 for fp8 and, for int8, amax / 127 of the first prefill's K/V per layer
            (docs/engine.md).
        async_scheduling: schedule and launch step N+1 while the device still runs step N (its sampled ids are
            gathered on the device; the host reads them while the next step runs), so the host's per-step work
            overlaps the GPU's (vLLM's ``async_scheduling``, SGLang's overlap scheduler). Stops are then seen
            one step late (the extra token is discarded); steps that sample a penalized sequence wait for the
            previous step first. None: on for CUDA devices, off on CPU. Tokens are the same either way.
        cascade_attention: run steps whose sequences share prefix blocks (prefix caching) as cascade
            attention: each group's shared prefix read once for all its members' new tokens, merged with each
            member's own blocks by log-sum-exp (Ye et al. 2024; FlashInfer's and vLLM's cascade attention);
            decode steps inside their CUDA graphs, steps with prefill chunks eagerly. None (default): on for
            CUDA with prefix caching and an unquantized pool, for steps whose shared prefixes save enough
            reads (``CascadePolicy()``); True: every step with a shared prefix (unquantized KV pools only);
            False: off. On the H200 the shared-prefix benchmark ran 12.8 s with the defaults, 8.8 s adding
            ``scheduling_policy="lpm"``, 34.5 s without prefix caching; where nothing is shared it measured
            within noise (docs/engine.md). Exact attention either way (float rounding aside).
        freeze_gc: once the engine is built (weights, KV pool, CUDA graphs), ``gc.collect()`` then
            ``gc.freeze()``: every object alive then (the model, torch, the engine, and the rest of the
            process) moves to Python's permanent generation, which the cyclic collector never scans, as vLLM
            does after start-up. On the H200 a full collection of the ~470k objects such a process holds
            paused the engine ~330 ms once in every shared-prefix run; frozen it is gone. Deleting the ``LLM``
            calls ``gc.unfreeze()`` (so the deleted engine's reference cycles can be collected; other live
            engines are then scanned again). None: on for CUDA devices, off on CPU.
        warmup: at start-up, after the CUDA graphs are captured, run dummy steps over the shapes the scheduler
            can produce (prefill token counts over LayerZero's power-of-two buckets up to
            ``max_num_batched_tokens``, chunked and mixed prefill + decode steps, decode batch sizes up to
            ``max_num_seqs``) and every sampler path, so first-use compiles (Triton JIT, LayerZero's selection
            of new shape buckets, FlashInfer modules) happen before the first request, not inside it (vLLM's
            ``compile_or_warm_up_model``). Writes no KV (slot -1) and leaves the scheduler, the prefix cache
            and every random stream as they were. None: on for CUDA devices, off on CPU (no JIT there).
            ``stats()`` reports ``startup_s``, ``warmup_s`` and ``warmup_shapes`` (docs/engine.md, "Start-up
            and warm-up").
        tensor_parallel_size: ranks holding the model (one process and device each: rank 0 in this process,
            ranks 1..N-1 spawned; docs/parallel.md). enable_expert_parallel: split a MoE model's experts over
            the ranks instead of each expert's intermediate size (ignored, with a warning, for dense models,
            as vLLM does). data_parallel_size: 1 (replicas serve through :class:`AsyncLLM`). load_format:
            ``"auto"`` (the checkpoint's weights) or ``"dummy"`` (seeded random weights, config.json still
            read: benchmark a shape without its weights).
        speculative_config: speculative decoding: vLLM's keys as a dict or JSON string, or a
            ``SpeculativeConfig``; None: off (docs/decoding.md, "Speculative decoding").
        logits_processors (keyword): logits-processor plugins, vLLM v1's interface: classes or
            ``"module:Class"`` names (docs/decoding.md, "Token restrictions and logits processors").
        idle_poll_s (keyword; :class:`AsyncLLM`'s engine core process only, ``LLM`` has no idle loop): seconds
            the core keeps polling for new requests, busy, after its last step, before it blocks until one
            comes (SGLang's scheduler always polls). A blocked core sleeps on a CPU that drops into idle
            states; its next request then waits for it to wake (~0.5 ms) and runs its host-bound first step
            on cold caches and clocks (+15% on the 2-core CPU VM). On the H200 most of the slowdown after an
            idle gap is the GPU's, which polling does not remove: at 1 req/s it moved the time to first
            token's p50 by -0.5 ms and its p99 from 70 to 31 ms (docs/serving.md). Costs one CPU core while
            it polls. None: 2 on CUDA, 0 (off) on CPU, where the engine's own threads need the cores.

    Raises:
        ConfigurationError: a bad option, an unsupported architecture, a checkpoint that does not match its
            config, a KV pool too small for one ``max_model_len`` sequence.
    """

    def __init__(
        self,
        model: str | Path,
        *,
        dtype: torch.dtype | None = None,
        device: str | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory_fraction: float = 0.9,
        enable_prefix_caching: bool = True,
        prefix_cache: str = "radix",
        scheduling_policy: str = "fcfs",
        enforce_eager: bool = False,
        seed: int = 0,
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        async_scheduling: bool | None = None,
        cascade_attention: bool | None = None,
        freeze_gc: bool | None = None,
        warmup: bool | None = None,
        tensor_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        data_parallel_size: int = 1,
        load_format: str = "auto",
        speculative_config: dict[str, Any] | SpeculativeConfig | str | None = None,
        **kwargs: Any,
    ) -> None:
        t0 = time.perf_counter()
        ec = EngineConfig(
            str(model),
            dtype,
            device,
            max_model_len,
            max_num_seqs,
            max_num_batched_tokens,
            block_size,
            num_kv_blocks,
            kv_cache_memory_fraction,
            enable_prefix_caching,
            prefix_cache,
            scheduling_policy,
            enforce_eager,
            seed,
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
            async_scheduling=async_scheduling,
            cascade_attention=cascade_attention,
            freeze_gc=freeze_gc,
            warmup=warmup,
            tensor_parallel_size=tensor_parallel_size,
            enable_expert_parallel=enable_expert_parallel,
            data_parallel_size=data_parallel_size,
            load_format=load_format,
            speculative_config=speculative_config,
            **kwargs,
        )
        if ec.data_parallel_size > 1:
            raise bad_config(
                "LLM data_parallel_size",
                "1 (LLM is one engine)",
                repr(ec.data_parallel_size),
                "Data-parallel replicas serve online: AsyncLLM(..., data_parallel_size=N) or "
                '`layerzero serve --data-parallel-size N` (docs/parallel.md, "Data parallel").',
            )
        tokenizer = load_tokenizer(ec.model)
        #: The engine core (scheduler, KV cache manager, executor), in this process and thread.
        self.engine = EngineCore(ec)
        self.input_processor = InputProcessor.from_config(ec, tokenizer, self.engine.model_config)
        self.output_processor = OutputProcessor(tokenizer)
        self._tokenizer = tokenizer
        #: Serializes the front end and the core (re-entrant): several threads may call generate / stream;
        #: each step runs whole, for every caller's requests, and each request's outputs land in its box.
        self._lock = threading.RLock()
        self._boxes: dict[str, _Box] = {}
        self._aborts: collections.deque[str] = collections.deque()  # request ids to abort (any thread)
        self._ids = itertools.count()
        if ec.freeze_gc if ec.freeze_gc is not None else self.engine.device.type == "cuda":
            gc.collect()
            gc.freeze()
            # not a method of self: a finalizer holding self would keep it alive
            weakref.finalize(self, gc.unfreeze)
        self.engine.stats.startup_s = time.perf_counter() - t0  # the whole constructor (tokenizer too)

    @property
    def tokenizer(self) -> Any:
        """The checkpoint's transformers tokenizer (None when it has none)."""
        return self._tokenizer

    def _add_all(self, prompts: Any, sampling_params: Any, priority: Any, kind: OutputKind) -> list[_Box]:
        """Validate every prompt and parameter first, then queue them all (nothing is queued when one is
        bad); returns each request's box."""
        if _is_one_prompt(prompts):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise bad_input(
                "prompts",
                "a prompt or a non-empty list of prompts (strings or token-id lists)",
                repr(prompts)[:80],
            )
        n = len(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * n
        prios = list(priority) if isinstance(priority, (list, tuple)) else [priority or 0] * n
        if len(params) != n or len(prios) != n:
            raise bad_input(
                "sampling_params / priority", f"one, or one per prompt ({n})", f"{len(params)} / {len(prios)}"
            )
        inputs = self.input_processor
        boxes: list[_Box] = []
        with self._lock:  # the tokenizer is shared with the steps' detokenization
            checked = [inputs.validate(p, sp, pr) for p, sp, pr in zip(prompts, params, prios, strict=True)]
            try:
                for (text, ids), sp, pr in zip(checked, params, prios, strict=True):
                    sp = inputs.with_bad_words(sp)  # noqa: PLW2901 (bad words -> token ids)
                    rid = str(next(self._ids))
                    req = EngineCoreRequest(rid, ids, sp, int(pr), time.time(), inputs.eos_token_id)
                    self.output_processor.add_request(rid, text, ids, sp, output_kind=kind)
                    box = self._boxes[rid] = _Box(rid)
                    boxes.append(box)
                    self.engine.add_request(req)
            except BaseException:
                self._abort_all(boxes)
                raise
            return boxes

    def _abort_all(self, boxes: list[_Box]) -> None:
        """Abort (and forget) each of ``boxes``' requests, finished or not."""
        self.abort([b.request_id for b in boxes])

    def _step(self) -> list[Any]:
        """Run one core step, hand each request's news to its box; return the step's core outputs."""
        with self._lock:
            try:
                step = self.engine.step()
                outs = step.outputs
                res = self.output_processor.process_outputs(outs, step.timestamp)
                if res.aborts:  # stop strings: the core stops those completions before the next step
                    self.engine.abort_requests(res.aborts)
                for ro in res.request_outputs:
                    box = self._boxes.get(ro.request_id)
                    if box is not None:
                        box.put(ro)
            finally:
                self._apply_aborts()
        return outs

    def _apply_aborts(self) -> None:
        """Abort the queued request ids (:meth:`abort`); the caller holds the lock."""
        while self._aborts:
            rid = self._aborts.popleft()
            box = self._boxes.pop(rid, None)
            ro = self.output_processor.abort_request(rid)
            if ro is not None:
                self.engine.abort_requests([EngineCoreAbort(rid)])
                if box is not None:
                    box.put(ro)

    def _collect(self, box: _Box) -> RequestOutput:
        """``box``'s request output (its merged deltas); a finished request's box is dropped."""
        with self._lock:
            out = box.take()
            if out.finished and self._boxes.get(box.request_id) is box:
                del self._boxes[box.request_id]
            return out

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: int | Sequence[int] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate completions for ``prompts`` (a string, a token-id list or tuple or 1-D integer array, or a
        list of them); returns one :class:`RequestOutput` per prompt, in input order, each with its
        ``request_id``. ``sampling_params``: one for all or one per prompt (default ``SamplingParams()``);
        ``priority``: per prompt with ``scheduling_policy="priority"`` (lower first).

        Safe to call from several threads (and while streams are open): every caller's requests share the
        steps and each caller collects its own. A request that fails inside a step ends with
        ``finish_reason="error"`` and ``RequestOutput.error``; the others complete. On any exception
        (``KeyboardInterrupt`` included) the call aborts its own requests, freeing their blocks, and
        re-raises.

        Raises:
            InvalidInputError: any bad prompt or parameter (see :class:`SamplingParams`); raised before any
                request is queued.
        """
        boxes = self._add_all(prompts, sampling_params, priority, "final_only")
        bar = _progress(len(boxes)) if use_tqdm else None
        try:
            done = 0
            while done < len(boxes):
                self._step()
                now = sum(b.finished for b in boxes)
                if bar is not None and now > done:
                    bar.update(now - done)
                done = now
            return [self._collect(b) for b in boxes]
        except BaseException:
            self._abort_all(boxes)
            raise
        finally:
            if bar is not None:
                bar.close()

    def beam_search(self, prompts: Sequence[Any], params: Any, *, use_tqdm: bool = False) -> list[Any]:
        """vLLM's ``LLM.beam_search`` with transformers' results: one ``BeamSearchOutput`` per prompt
        (:func:`~layerzero.engine.beam_search.llm_beam_search`, which documents it and its errors)."""
        from .beam_search import llm_beam_search

        return llm_beam_search(self, prompts, params)

    def stream(
        self, prompt: str | list[int], sampling_params: SamplingParams | None = None, *, priority: int = 0
    ) -> Iterator[RequestOutput]:
        """Generate for one prompt, yielding :class:`RequestOutput` deltas: each holds the text and token ids
        new since the previous yield; the last one has ``finished`` True and the finish reasons. Text that
        might become a stop string is held back until it is known not to be one. Leaving the loop early
        (``break``, ``close()``, an exception, the generator collected) aborts the request and frees its KV
        blocks. Several streams (and ``generate`` calls) may be open at once: each gets its own request's
        tokens, whichever of them runs the step.

        Raises:
            InvalidInputError: as :meth:`generate`, before anything is queued.
        """
        (box,) = self._add_all([prompt], sampling_params, [priority], "delta")
        done = False
        try:
            while not done:
                if not box.has_news:
                    self._step()
                    if not box.has_news:
                        continue
                out = self._collect(box)
                done = out.finished
                if done or any(o.text or o.token_ids for o in out.outputs):
                    yield out
        finally:  # the consumer stopped early (break, close, an exception): free the request's blocks
            if not done:
                self.abort(box.request_id)

    def abort(self, request_id: str | Sequence[str]) -> list[str]:
        """Abort requests by id (``RequestOutput.request_id``), from any thread: each ends with
        ``finish_reason="abort"`` and its blocks are freed; the ``generate`` / ``stream`` waiting for it
        returns it as aborted. Never waits for a step: while another thread runs one, the abort is applied
        when that step ends. Returns the ids that were known (unknown or collected ids are ignored)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        known = [rid for rid in ids if rid in self._boxes]
        self._aborts.extend(known)
        if self._aborts and self._lock.acquire(blocking=False):
            try:
                self._apply_aborts()
            finally:
                self._lock.release()
        return known

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to conversations (``[{"role": ..., "content": ...}, ...]``, or a list of them)
        with the tokenizer's chat template (transformers' ``apply_chat_template``, generation prompt added).

        Raises:
            InvalidInputError: no tokenizer or no chat template; messages that are not a conversation (a list
                of dicts with string ``role`` and ``content``) or a non-empty list of them; a template that
                fails on them; bad parameters.
        """
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise bad_input(
                "chat",
                "a checkpoint whose tokenizer has a chat template",
                "none",
                "Use generate() with a formatted prompt.",
            )
        convs = conversations(messages)
        prompts = []
        for c in convs:
            try:
                prompts.append(
                    list(
                        tok.apply_chat_template(
                            c, add_generation_prompt=True, tokenize=True, return_dict=True
                        )["input_ids"]
                    )
                )
            except Exception as exc:  # jinja2's and the tokenizer's errors
                raise bad_input(
                    "chat messages",
                    "a conversation the chat template accepts",
                    f"{type(exc).__name__}: {exc}",
                ) from exc
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stats(self) -> dict[str, Any]:
        """Engine statistics: steps, prompt / generated tokens, preemptions, prefix-cache hit rate, KV usage,
        time per phase (schedule / forward / sample / detokenize, seconds; ``detokenize`` is the core's
        update phase: appending the tokens and its stop checks), the last step, and start-up: ``startup_s``,
        ``warmup_s``, ``warmup_shapes`` (see docs/engine.md); ``spec_decode`` (speculative decoding's
        counters, docs/decoding.md)."""
        return self.engine.stats.as_dict()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block (vLLM's ``LLM.reset_prefix_cache``): the next requests compute their
        prompts' KV again, as in a new engine. False (nothing dropped) while a request holds blocks."""
        with self._lock:
            return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Abort every request and release the engine: the model, the KV cache and, with
        ``tensor_parallel_size > 1``, the worker processes and the process group (interpreter exit and
        garbage collection stop the workers too)."""
        with self._lock:
            self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


class _Box:
    """One request's outbox in :class:`LLM`: the outputs the steps produced for it (whoever ran them), merged
    when collected (deltas concatenate)."""

    __slots__ = ("finished", "outputs", "request_id")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.outputs: list[RequestOutput] = []
        self.finished = False

    @property
    def has_news(self) -> bool:
        return bool(self.outputs)

    def put(self, out: RequestOutput) -> None:
        if not self.finished:
            self.outputs.append(out)
            self.finished = out.finished

    def take(self) -> RequestOutput:
        outs, self.outputs = self.outputs, []
        return outs[0] if len(outs) == 1 else merge_deltas(outs)


def _is_one_prompt(prompts: Any) -> bool:
    """A single prompt: text, a 1-D integer array, or a list / tuple of token ids (not of prompts)."""
    if isinstance(prompts, (str, np.ndarray)):
        return True
    return (
        isinstance(prompts, (list, tuple))
        and bool(prompts)
        and isinstance(prompts[0], (numbers.Integral, np.integer))
    )


def _progress(total: int) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional: no bar
        return None
    return tqdm(total=total, desc="Generating", unit="req", dynamic_ncols=True)
