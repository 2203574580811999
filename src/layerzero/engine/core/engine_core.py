"""``EngineCore``: the engine's core (vLLM V1's ``EngineCore``): requests in as
:class:`~.messages.EngineCoreRequest`, one step at a time out as :class:`~.messages.EngineCoreOutputs`
(token ids only). Owns the scheduler, the KV cache manager and an executor; speaks plain data only, so it can
run in another process. The step loop is :class:`~.llm_engine.EngineLoop`, failure recovery
:class:`~.recovery.StepRecovery`."""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

import torch

import layerzero.telemetry as lzt

from ..config import EngineConfig, ModelConfig, resolve_device, resolve_max_model_len
from ..errors import bad_input
from ..executor.abstract import Executor
from ..executor.in_process import InProcessExecutor
from ..executor.multiproc import MultiprocExecutor
from ..metrics import EngineStats
from ..spec_decode.state import SpecDecodeState
from ..structured.manager import StructuredOutputManager
from ..worker.model_runner import ModelRunner
from ..worker.sampler import sequence_seed
from .kv.block_manager import KVCacheManager
from .llm_engine import EngineLoop
from .messages import EngineCoreAbort, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from .request import InFlight, Request
from .sched.policy import make_policy
from .sched.scheduler import Scheduler
from .sequence import PromptLogprobs, Sequence

__all__ = ["DEFAULT_MAX_NUM_BATCHED_TOKENS", "EngineCore"]

log = logging.getLogger("layerzero.engine")

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


def resolve_dtype(ec: EngineConfig, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """The model's dtype: ``ec.dtype``, else float32 on the CPU and the checkpoint's half dtype (bfloat16
    unless it is float16) on CUDA."""
    if ec.dtype is not None:
        return ec.dtype
    if device.type == "cpu":
        return torch.float32
    return cfg.torch_dtype if cfg.torch_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


class EngineCore(EngineLoop):
    """The engine core for ``engine_config``: builds the executor (which loads the model and sizes the KV
    pool), the KV cache manager and the scheduler. Implements
    :class:`~.messages.EngineCoreProtocol`; every method is safe to call from several threads (one lock; a
    step runs whole) and :meth:`abort_requests` never waits for a step.

    Raises:
        ConfigurationError: a bad option, an unsupported architecture, a checkpoint that does not match its
            config, a KV pool too small for one ``max_model_len`` sequence.
    """

    def __init__(self, engine_config: EngineConfig, executor: Executor | None = None) -> None:
        t0 = time.perf_counter()
        ec = self.config = engine_config
        self.model_config = cfg = ModelConfig.from_pretrained(ec.model)
        self.device = resolve_device(ec.device)
        self.dtype = resolve_dtype(ec, cfg, self.device)
        self.max_model_len = resolve_max_model_len(ec, cfg)
        budget = ec.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
        if ec.enable_expert_parallel and cfg.moe is None:
            log.warning(
                "enable_expert_parallel: %s has no MoE layers; the flag changes nothing (as in vLLM)",
                cfg.model_type,
            )
        if executor is None:
            kind = InProcessExecutor if ec.tensor_parallel_size == 1 else MultiprocExecutor
            executor = kind(cfg, ec, self.device, self.dtype, self.max_model_len, budget)
        self.executor = executor
        self.kv = KVCacheManager(
            self.executor.num_kv_blocks,
            ec.block_size,
            enable_prefix_caching=ec.enable_prefix_caching,
            prefix_cache=ec.prefix_cache,
        )
        self.scheduler = Scheduler(
            self.kv,
            make_policy(ec.scheduling_policy),
            max_num_seqs=ec.max_num_seqs,
            max_num_batched_tokens=budget,
        )
        if ec.speculative_config is not None:
            self.scheduler.spec = SpecDecodeState(ec.speculative_config, self.max_model_len)
        self.vocab_size = cfg.vocab_size
        self.eos = set(cfg.eos_token_ids)
        self.requests: dict[str, Request] = {}
        #: Structured outputs: grammar matchers per sequence, compiled grammars (docs/decoding.md).
        self.structured = StructuredOutputManager(ec.model, cfg.vocab_size, self.eos)
        #: Prefill token counts (rounded up to powers of two) of the steps run so far (kernel_report()).
        self.prefill_buckets: set[int] = set()
        self.stats = EngineStats(num_kv_blocks=self.executor.num_kv_blocks)
        runner = self.executor.runner
        self.stats.weights_bytes, self.stats.weights_load_s = runner.weights_bytes, runner.weights_load_s
        warm = getattr(self.executor, "warmup", None)  # the worker's start-up warm-up (None: off)
        if warm is not None:
            self.stats.warmup_s, self.stats.warmup_shapes = warm.seconds, warm.shapes
        self.async_scheduling = (
            ec.async_scheduling if ec.async_scheduling is not None else self.device.type == "cuda"
        )
        self._inflight: InFlight | None = None
        self._current: list[tuple[Sequence, int]] | None = None  # the step being run (a failure rolls back)
        self._launching: list[Sequence] | None = None  # its sampled sequences (a SamplingError's rows)
        self._outputs: list[EngineCoreOutput] = []  # what the next step() returns
        #: Serializes every entry point that reads or changes requests or runs a step (re-entrant).
        self.lock = threading.RLock()
        self._aborts: collections.deque[EngineCoreAbort] = collections.deque()  # from any thread
        #: Requests added with ``retain_kv``: their one sequence, whose block table outlives its finish.
        self.retained: dict[str, Sequence] = {}
        self.stats.startup_s = time.perf_counter() - t0

    @property
    def runner(self) -> ModelRunner:
        """The in-process executor's model runner (tests, benchmarks, tools)."""
        return self.executor.runner

    # ------------------------------------------------------------------------------------------ requests
    def add_request(
        self,
        request: EngineCoreRequest,
        *,
        fork_of: tuple[str, int] | None = None,
        retain_kv: bool = False,
    ) -> None:
        """Queue ``request`` (validated by the front end: ids in the vocabulary, at most ``max_model_len``
        tokens); its ``n`` completions wait for the scheduler. ``request.eos_token_id`` (the front end's
        tokenizer's EOS) joins the model's EOS ids when it is inside the vocabulary.

        A ``structured_outputs`` constraint is compiled here (its backend chosen, the grammar cached) and each
        completion gets its own grammar matcher.

        Internal, for beam search (not part of the vLLM API): ``retain_kv`` keeps the request's block table
        after it finishes, until :meth:`release_kv`; ``fork_of`` ``(parent_request_id, num_tokens)`` admits it
        as a copy-on-write fork of a retained request's KV: its first ``num_tokens`` prompt tokens (the
        parent's first tokens, their KV computed) are not computed again (docs/decoding.md, "Beam search and
        n"). Both need ``n == 1``; ``fork_of`` no prompt logprobs.

        Raises:
            InvalidInputError: a request id that is empty, not a string, queued or retained already; a
                structured-output constraint no backend compiles; a ``fork_of`` parent that is not retained,
                ``num_tokens`` outside ``[1, min(parent's computed tokens, len(prompt) - 1)]`` or a prompt
                that does not start with the parent's first ``num_tokens`` tokens (nothing queued in any
                case).
        """
        rid, params, ids = request.request_id, request.sampling_params, request.prompt_token_ids
        if not isinstance(rid, str) or not rid:
            raise bad_input("request_id", "a non-empty string", repr(rid))
        with self.lock:
            if rid in self.requests or rid in self.retained:
                raise bad_input("request_id", "a new id", repr(rid))
            parent = None if fork_of is None and not retain_kv else self._check_fork(request, fork_of)
            self._add_eos(request.eos_token_id)
            self.structured.prepare(params)
            plp = None if params.prompt_logprobs is None else PromptLogprobs(params.prompt_logprobs, len(ids))
            seqs = [
                Sequence(
                    rid,
                    i,
                    list(ids),
                    len(ids),
                    params,
                    priority=int(request.priority),
                    seed=None if params.seed is None else sequence_seed(params.seed, i),
                    prompt_lp=plp,
                )
                for i in range(params.n)
            ]
            self.requests[rid] = Request(rid, seqs)
            if retain_kv:
                self.retained[rid] = seqs[0]
            for seq in seqs:
                if params.structured_outputs is not None:
                    self.structured.add(seq)
                self.scheduler.add(seq, fork_of=parent, retain_kv=retain_kv)

    def _check_fork(
        self, request: EngineCoreRequest, fork_of: tuple[str, int] | None
    ) -> tuple[Sequence, int] | None:
        """``fork_of`` checked (see :meth:`add_request`) as (parent sequence, num_tokens), or None."""
        params, ids = request.sampling_params, request.prompt_token_ids
        if params.n != 1:
            raise bad_input("n with fork_of / retain_kv", 1, params.n, "Fork and retain one sequence each.")
        if fork_of is None:
            return None
        if params.prompt_logprobs is not None:
            raise bad_input("prompt_logprobs with fork_of", None, params.prompt_logprobs)
        if not isinstance(fork_of, tuple) or len(fork_of) != 2:
            raise bad_input("fork_of", "(parent_request_id, num_tokens)", repr(fork_of))
        prid, num = fork_of
        parent = self.retained.get(prid)
        if parent is None:
            raise bad_input("fork_of parent", "a request added with retain_kv and not released", repr(prid))
        hi = min(parent.num_computed_tokens, len(ids) - 1)
        if isinstance(num, bool) or not isinstance(num, int) or not 1 <= num <= hi:
            raise bad_input("fork_of num_tokens", f"an int in [1, {hi}]", repr(num))
        if list(ids[:num]) != parent.token_ids[:num]:
            raise bad_input("fork_of prompt", f"the parent {prid!r}'s first {num} tokens", "different tokens")
        return parent, num

    def release_kv(self, request_id: str) -> None:
        """Free the block table a ``retain_kv`` request kept (at once when it finished, else when it
        finishes; its full blocks stay in the prefix cache); waiting forks of it are then prefilled the
        ordinary way. Unknown or released ids are ignored."""
        with self.lock:
            seq = self.retained.pop(request_id, None)
            if seq is not None:
                self.scheduler.release(seq)

    def _add_eos(self, eos: int | None) -> None:
        if eos is None or eos in self.eos:
            return
        if 0 <= eos < self.vocab_size:
            self.eos.add(eos)
        else:  # a tokenizer wider than the model: its EOS can never be sampled
            log.warning(
                "the tokenizer's eos_token_id %d is outside the model's vocabulary [0, %d): not used as a "
                "stop token",
                eos,
                self.vocab_size,
            )
            self.eos.add(eos)  # (never matches a sampled id; warns once)

    def abort_requests(self, aborts: list[EngineCoreAbort]) -> None:
        """End completions early (``reason`` ``"abort"``, or ``"stop"`` with the front end's stop string):
        their blocks are freed and each gets a last output with that finish reason in the next
        :meth:`step`. Never waits for a step: while another thread runs one, the aborts are applied when it
        ends; otherwise at once. Unknown or finished ids are ignored."""
        self._aborts.extend(aborts)
        self._try_apply_aborts()

    def has_unfinished_requests(self) -> bool:
        """Whether any request is queued or running, or a launched step still has tokens to read for one."""
        self._try_apply_aborts()
        f = self._inflight
        return self.scheduler.has_unfinished() or (f is not None and any(not s.finished for s in f.sampled))

    has_unfinished = has_unfinished_requests

    def step(self) -> EngineCoreOutputs:
        """Run one step (schedule -> execute -> update) and return what every completion gained (with async
        scheduling: the tokens of the step launched before; see :class:`~.llm_engine.EngineLoop`)."""
        with self.lock:
            self._run_step()
            outs, self._outputs = self._outputs, []
            return EngineCoreOutputs(outs, time.monotonic(), self._scheduler_stats())

    def shutdown(self) -> None:
        """Abort every request and release the model and the KV cache."""
        with self.lock:
            self.abort_requests([EngineCoreAbort(rid) for rid in list(self.requests)])
            self._inflight = None
            self.structured.clear()
            self.executor.shutdown()

    # ------------------------------------------------------------------------------------------ state
    def _scheduler_stats(self) -> SchedulerStats:
        kv = self.kv.stats()
        st = self.stats
        return SchedulerStats(
            len(self.scheduler.running),
            len(self.scheduler.waiting),
            self.kv.usage(),
            kv.queries,
            kv.hits,
            self.scheduler.num_preemptions,
            st.prompt_tokens,
            st.generation_tokens,
            *self._spec_stats(),
        )

    def _spec_stats(self) -> tuple[int, int, int, list[int]]:
        """Speculative decoding's counters for :class:`SchedulerStats` (zeros when off)."""
        sp = self.scheduler.spec
        if sp is None:
            return 0, 0, 0, []
        return sp.num_drafts, sp.num_draft_tokens, sp.num_accepted_tokens, list(sp.accepted_per_pos)

    def get_stats(self) -> SchedulerStats:
        """The core's state now (completions running / waiting, KV usage, counters since start)."""
        with self.lock:
            return self._scheduler_stats()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block no request holds; False when some are still held (nothing done)."""
        with self.lock:
            return self.kv.reset_prefix_cache()

    def kernel_report(self) -> dict[str, Any]:
        """Plain data: for each LayerZero op the model runs, per shape bucket (``"decode/1"``, and
        ``"prefill/N"`` for each prefill size the steps have run, tokens rounded up to a power of two), the
        kernel LayerZero selects and why (score, eligible / rejected counts, the selection bucket), from
        ``lz.dry_run`` of one forward per bucket made now (ops selected and recorded, no kernel run:
        :meth:`~layerzero.engine.worker.model_runner.ModelRunner.kernel_report`); decode as the CUDA graphs
        select (``lz.capture_selection``). The steps themselves are not traced (no hot-path cost)."""
        with self.lock:
            report = getattr(self.executor, "kernel_report", None)  # every rank's, where there are several
            return (
                report(self._buckets()) if report is not None else self.runner.kernel_report(self._buckets())
            )

    def enable_dispatch_counters(self, sample_every: int = 64) -> bool:
        """Turn on LayerZero's dispatch counters (``layerzero.telemetry``) in this process, where the model's
        kernels run; whether they were on already (then nothing changes). Kernels replayed inside CUDA graphs
        are not dispatched, so not counted."""
        was = lzt.is_enabled()
        if not was:
            lzt.enable(sample_every=sample_every)
        return was

    def dispatch_counters(self) -> dict[str, Any]:
        """LayerZero's dispatch counters of this process as plain data: ``enabled`` plus
        ``layerzero.telemetry.snapshot()`` (``calls``: kernel -> [op, n], ``selections``, ``cache_hits``,
        ``cache_misses``, ``fallbacks``, ``latency_us``, ...; docs/telemetry.md)."""
        return {"enabled": lzt.is_enabled(), **lzt.snapshot()}

    def _buckets(self) -> list[tuple[str, int]]:
        return [("decode", 1), *(("prefill", n) for n in sorted(self.prefill_buckets))]
