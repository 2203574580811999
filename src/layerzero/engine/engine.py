"""``LLMEngine``: requests in, one step at a time: schedule -> forward -> sample -> stops and text.

A step that raises is rolled back by the failure recovery it inherits (``recovery.py``); the request state
it keeps (:class:`Request`) is in ``request.py``."""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from typing import Any

import torch

from .config import EngineConfig, ModelConfig, resolve_device
from .detokenizer import Detokenizer
from .errors import bad_config, bad_input
from .inputs import InputProcessor
from .kv.block_manager import KVCacheManager
from .metrics import EngineStats, StepStats
from .outputs import CompletionOutput, RequestOutput
from .recovery import StepRecovery
from .request import InFlight, Request
from .runner.model_runner import ModelRunner
from .sampler import Sampler, SamplerOutput, plain_greedy, sequence_seed
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .scheduling_policy import make_policy
from .sequence import FinishReason, Sequence

__all__ = ["LLMEngine", "Request"]

log = logging.getLogger("layerzero.engine")

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


def _resolve(ec: EngineConfig, cfg: ModelConfig) -> tuple[torch.device, torch.dtype]:
    device = resolve_device(ec.device)
    if ec.dtype is not None:
        return device, ec.dtype
    if device.type == "cpu":
        return device, torch.float32
    return device, cfg.torch_dtype if cfg.torch_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


class LLMEngine(StepRecovery):
    """The engine behind :class:`~layerzero.engine.LLM`: owns the tokenizer, model runner, KV cache manager,
    scheduler and sampler; ending requests and undoing a failed step come from :class:`StepRecovery`."""

    def __init__(self, ec: EngineConfig, tokenizer: Any = None) -> None:
        self.config = ec
        self.model_config = cfg = ModelConfig.from_pretrained(ec.model)
        self.device, self.dtype = _resolve(ec, cfg)
        self.tokenizer = tokenizer
        self.max_model_len = ec.max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            raise bad_config(
                "max_model_len",
                f"<= the model's max_position_embeddings ({cfg.max_position_embeddings})",
                self.max_model_len,
            )
        budget = ec.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
        self.runner = ModelRunner(cfg, ec, self.device, self.dtype, self.max_model_len, budget)
        self.kv = KVCacheManager(
            self.runner.num_blocks,
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
        self.sampler = Sampler(cfg.vocab_size, cfg.eos_token_ids, self.device, ec.seed)
        self.eos = set(cfg.eos_token_ids)
        gen_eos = getattr(tokenizer, "eos_token_id", None)
        if isinstance(gen_eos, int) and 0 <= gen_eos < cfg.vocab_size:
            self.eos.add(gen_eos)
        elif isinstance(gen_eos, int):  # a tokenizer wider than the model: its EOS can never be sampled
            log.warning(
                "the tokenizer's eos_token_id %d is outside the model's vocabulary [0, %d): not used as a "
                "stop token",
                gen_eos,
                cfg.vocab_size,
            )
        self.inputs = InputProcessor(tokenizer, cfg.vocab_size, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats(num_kv_blocks=self.runner.num_blocks)
        self._ids = itertools.count()
        self.async_scheduling = (
            ec.async_scheduling if ec.async_scheduling is not None else self.device.type == "cuda"
        )
        self._inflight: InFlight | None = None
        self._current: SchedulerOutput | None = None  # the step being run (what a failure rolls back)
        #: Serializes every entry point that reads or changes requests or runs a step (re-entrant): several
        #: threads may drive one engine; each step runs whole, for every caller's requests at once.
        self.lock = threading.RLock()
        self._aborts: collections.deque[str] = collections.deque()  # request ids to abort (any thread)

    # ------------------------------------------------------------------------------------------ requests
    def validate(
        self, prompt: str | list[int], params: SamplingParams, priority: int = 0
    ) -> tuple[str | None, list[int]]:
        """Every check of one request, nothing queued: (prompt text or None, token ids) for :meth:`enqueue`
        (:meth:`InputProcessor.validate <layerzero.engine.inputs.InputProcessor.validate>`)."""
        return self.inputs.validate(prompt, params, priority)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        request_id: str | None = None,
    ) -> Request:
        """Validate and queue one request (``n`` sequences). Nothing is queued when it raises.

        Raises:
            InvalidInputError: see :meth:`validate`; a duplicate request id.
        """
        text, ids = self.validate(prompt, params, priority)
        return self.enqueue(text, ids, params, priority, request_id)

    def enqueue(
        self,
        text: str | None,
        ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        request_id: str | None = None,
    ) -> Request:
        """Queue a request whose prompt and parameters :meth:`validate` accepted (``text``/``ids`` as it
        returned).

        Raises:
            InvalidInputError: a duplicate request id (nothing queued).
        """
        with self.lock:
            return self._enqueue(text, ids, params, int(priority), request_id)

    def _enqueue(
        self, text: str | None, ids: list[int], params: SamplingParams, priority: int, request_id: str | None
    ) -> Request:
        rid = request_id if request_id is not None else str(next(self._ids))
        if not isinstance(rid, str) or not rid:
            raise bad_input("request_id", "a non-empty string or None", repr(rid))
        if rid in self.requests:
            raise bad_input("request_id", "a new id", repr(rid))
        seqs = []
        for i in range(params.n):
            seed = None if params.seed is None else sequence_seed(params.seed, i)
            seq = Sequence(
                rid,
                i,
                list(ids),
                len(ids),
                params,
                priority=priority,
                seed=seed,
                logprobs=[] if params.logprobs is not None else None,
            )
            if self.tokenizer is not None:
                seq.detok = Detokenizer(self.tokenizer, ids, params.stop_strings, params.skip_special_tokens)
            seqs.append(seq)
        req = Request(rid, text, ids, seqs, [0] * len(seqs))
        self.requests[rid] = req
        for seq in seqs:
            self.scheduler.add(seq)
        return req

    def abort(self, request_id: str) -> bool:
        """End a request (finish reason ``"abort"``), freeing its blocks, and forget it (a finished request
        whose output was not read is dropped); False when it is not known. Never waits for a step: while
        another thread runs one, the abort is queued and applied when that step ends (at the latest when the
        next one starts); otherwise at once."""
        if request_id not in self.requests:
            return False
        self._aborts.append(request_id)
        self._try_apply_aborts()
        return True

    def has_unfinished(self) -> bool:
        """Whether any request is queued or running, or a launched step still has tokens to read for one."""
        self._try_apply_aborts()
        f = self._inflight
        return self.scheduler.has_unfinished() or (f is not None and any(not s.finished for s in f.sampled))

    # ------------------------------------------------------------------------------------------ the step
    def step(self) -> list[Request]:
        """Run one step; returns the requests that got new tokens or finished. With async scheduling the step
        launches the next forward, then reads the previous one's tokens (those are what it returns).

        A step that raises fails only the requests it concerns: the rows whose sampling raised (each row is
        retried alone to find them), else every request of the step; they end with ``"error"`` (their blocks
        freed) and the step returns them. The step's other sequences are rolled back (:meth:`_recover`) and
        run again, so the engine stays usable. A ``BaseException`` (``KeyboardInterrupt``) rolls the step
        back, fails nothing, and propagates."""
        with self.lock:
            self._apply_aborts()
            self._current = None
            was_idle = self._inflight is None  # else the step reads the launched one: progress
            try:
                touched = self._step_async() if self.async_scheduling else self._step_sync()
                if was_idle and not self._current.chunks:
                    self._check_progress()
            except Exception as exc:
                touched = self._recover(exc)
            except BaseException as exc:
                self._recover(exc)
                raise
            finally:
                self._current = None
                self._apply_aborts()
            return touched

    def _step_async(self) -> list[Request]:
        """Schedule and launch step N+1, then read step N's ids while N+1 runs on the device.

        N+1's sequences whose last token is N's pending draw get its id by a gather on the device (no host
        synchronization). Reading N may end sequences (stop ids, EOS, stop strings) that N+1 already computes:
        their extra token is dropped, their blocks freed (writes still queued on the stream land before any
        later step reuses them). A step whose pending sequences have penalties reads N first (penalties need
        the tokens), and so does nothing else: the tokens are the same as :meth:`_step_sync`'s."""
        touched: dict[str, Request] = {}
        prev = self._inflight
        t0 = time.perf_counter()
        appended = 0
        if prev is not None and any(s.params.penalized for s in prev.sampled if not s.finished):
            appended = self._read(prev, touched)[1]
            prev = self._inflight = None
        out = self._current = self.scheduler.schedule()
        t1 = time.perf_counter()
        launched = None
        if out.chunks:
            tables = self.kv.block_tables([s.seq_id for s, _ in out.chunks])
            sampled = [s for s, n in out.chunks if s.num_computed_tokens + n == s.num_tokens]
            res = self.runner.execute(
                out.chunks,
                tables,
                prev.pending.tokens if prev is not None else None,
                greedy=plain_greedy(sampled),
            )
            pending = res.pending if res.pending is not None else self.sampler.launch(res.logits, sampled)
            launched = InFlight(sampled, pending)
        t2 = time.perf_counter()
        t3 = t2
        if prev is not None:
            t3, n = self._read(prev, touched)
            appended += n
        self._inflight = launched
        if out.chunks:
            self.scheduler.after_forward(out)  # after the read: the blocks it fills hold known tokens only
            for j, seq in enumerate(launched.sampled):
                if not seq.finished:
                    seq.pending_index = j
                    seq.length_capped = self._length_reached(seq)  # counts the pending token just set
        return self._finish_step(out, appended, touched, (t0, t1, t2, t3, time.perf_counter()))

    def _read(self, prev: InFlight, touched: dict[str, Request]) -> tuple[float, int]:
        """Wait for ``prev``'s sampled ids and append them (stop checks, text); sequences that ended meanwhile
        (an abort) are skipped. Returns the time the ids arrived (``time.perf_counter``) and how many were
        appended."""
        res = Sampler.resolve(prev.pending)
        t = time.perf_counter()
        for seq in prev.sampled:
            seq.pending_index, seq.length_capped = None, False
        return t, self._append_all(prev.sampled, res, touched)

    def _append_all(self, seqs: list[Sequence], res: SamplerOutput, touched: dict[str, Request]) -> int:
        """Append each sequence's sampled token (:meth:`_append`), skipping sequences that ended meanwhile;
        returns how many were appended."""
        appended = 0
        for seq, tok, lp, top in zip(seqs, res.token_ids, res.logprobs, res.top_logprobs, strict=True):
            req = self.requests.get(seq.request_id)
            if seq.finished or req is None:
                continue
            try:
                self._append(seq, tok, lp, top)
            except (
                Exception
            ) as exc:  # e.g. the tokenizer cannot decode the token: this request fails, not the step
                log.error("request %s failed appending token %d: %s", seq.request_id, tok, exc, exc_info=exc)
                self._fail(req, exc)
            appended += 1
            touched[seq.request_id] = req
        return appended

    def _step_sync(self) -> list[Request]:
        """Schedule, forward, sample and read one step, in that order."""
        t0 = time.perf_counter()
        out = self._current = self.scheduler.schedule()
        t1 = t2 = t3 = time.perf_counter()
        touched: dict[str, Request] = {}
        appended = 0
        if out.chunks:
            tables = self.kv.block_tables([s.seq_id for s, _ in out.chunks])
            sampled = [s for s, n in out.chunks if s.num_computed_tokens + n == s.num_tokens]
            step = self.runner.execute(out.chunks, tables, greedy=plain_greedy(sampled))
            t2 = time.perf_counter()
            self.scheduler.after_forward(out)
            res = self.sampler.resolve(
                step.pending if step.pending is not None else self.sampler.launch(step.logits, sampled)
            )
            t3 = time.perf_counter()
            appended = self._append_all(sampled, res, touched)
        return self._finish_step(out, appended, touched, (t0, t1, t2, t3, time.perf_counter()))

    def _finish_step(
        self,
        out: SchedulerOutput,
        appended: int,
        touched: dict[str, Request],
        times: tuple[float, float, float, float, float],
    ) -> list[Request]:
        """Record the step's statistics (``times``: perf_counter at its start and after schedule, forward,
        sample and append) and return the requests it touched."""
        st = StepStats()
        st.num_preempted, st.num_seqs, st.num_sampled = len(out.preempted), len(out.chunks), appended
        st.num_prefill_tokens = sum(n for _, n in out.chunks if n > 1)
        st.num_decode_tokens = sum(n for _, n in out.chunks if n == 1)
        st.schedule_s, st.forward_s, st.sample_s, st.detokenize_s = (
            b - a for a, b in itertools.pairwise(times)
        )
        self.stats.record(st, self.kv.usage(), self.kv.stats().hit_rate)
        self.stats.preemptions = self.scheduler.num_preemptions
        self.stats.cascade_steps = self.runner.cascade_steps
        self.stats.cascade_saved_tokens = self.runner.cascade_saved_tokens
        for req in touched.values():
            if req.finished:
                self.stats.finished_requests += 1
        return list(touched.values())

    def _append(self, seq: Sequence, tok: int, lp: float | None, top: dict[int, float] | None) -> None:
        p = seq.params
        seq.token_ids.append(tok)
        if seq.logprobs is not None and top is not None:
            seq.logprobs.append(top)
            seq.cumulative_logprob += lp
        n = seq.num_output_tokens
        may_stop = n >= p.min_tokens
        if may_stop and p.stop_token_ids and tok in p.stop_token_ids:
            return self.scheduler.finish(seq, FinishReason.STOP, tok)
        if may_stop and not p.ignore_eos and tok in self.eos:
            return self.scheduler.finish(seq, FinishReason.STOP)
        if seq.detok is not None:
            hit = seq.detok.add(tok, may_stop)
            if hit is not None:
                return self.scheduler.finish(seq, FinishReason.STOP, hit)
        if self._length_reached(seq):
            return self.scheduler.finish(seq, FinishReason.LENGTH)
        return None

    def _length_reached(self, seq: Sequence) -> bool:
        """``max_tokens`` output tokens or ``max_model_len`` tokens (a pending one included)."""
        return seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len

    # ------------------------------------------------------------------------------------------ outputs
    def output(self, req: Request, *, delta: bool = False) -> RequestOutput:
        """The request's :class:`RequestOutput`: whole outputs, or (``delta``) only what is new since the last
        delta of that request. A finished request is forgotten once read (its id may be reused)."""
        with self.lock:
            return self._output(req, delta)

    @staticmethod
    def has_news(req: Request) -> bool:
        """Whether ``req`` finished or has output tokens a delta has not returned yet."""
        return req.finished or any(
            len(s.token_ids) - s.num_prompt_tokens > n for s, n in zip(req.seqs, req.sent_tokens, strict=True)
        )

    def _output(self, req: Request, delta: bool) -> RequestOutput:
        outs = []
        for i, s in enumerate(req.seqs):
            ids = s.output_token_ids
            reason = s.finish_reason.value if s.finish_reason else None
            if s.detok is not None:
                text = s.detok.delta(s.finished) if delta else s.detok.text
            else:
                text = ""
            start = req.sent_tokens[i] if delta else 0
            lps = None if s.logprobs is None else s.logprobs[start:]
            outs.append(
                CompletionOutput(s.index, text, ids[start:], s.cumulative_logprob, lps, reason, s.stop_reason)
            )
            if delta:
                req.sent_tokens[i] = len(ids)
        ro = RequestOutput(
            req.request_id,
            req.prompt,
            req.prompt_token_ids,
            outs,
            req.finished,
            max(s.num_cached_tokens for s in req.seqs),
            req.error,
        )
        if req.finished and self.requests.get(req.request_id) is req:
            del self.requests[req.request_id]
        return ro
