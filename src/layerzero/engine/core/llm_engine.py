"""The engine core's step loop: schedule -> execute -> update, one step at a time (:class:`EngineLoop`, the
part of :class:`~layerzero.engine.core.engine_core.EngineCore` that runs steps).

A step is data: the scheduler's plain :class:`~.sched.output.SchedulerOutput` goes to the executor, which
launches the forward and the draw; the sampled token ids come back as lists per sequence and are appended
here, where the core's stops are checked (EOS, ``stop_token_ids``, ``max_tokens``, ``max_model_len``); what
each completion gained is queued as an :class:`~.messages.EngineCoreOutput`. Stop strings, text and logprobs
formatting are the front end's (:mod:`layerzero.engine.frontend.output_processor`). A step that raises is
rolled back by the failure recovery it inherits (``recovery.py``)."""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

from ..metrics import EngineStats, StepStats
from ..structured.manager import GrammarRejectedError, StructuredOutputManager
from .errors import EngineDeadError
from .messages import EngineCoreOutput
from .recovery import StepRecovery
from .request import InFlight
from .sequence import FinishReason, Sequence

__all__ = ["EngineLoop"]

log = logging.getLogger("layerzero.engine")


class EngineLoop(StepRecovery):
    """Runs steps for :class:`~layerzero.engine.core.engine_core.EngineCore` (which sets ``executor``,
    ``kv``, ``scheduler``, ``eos``, ``max_model_len``, ``stats`` and ``async_scheduling`` besides what
    :class:`StepRecovery` needs)."""

    eos: set[int]
    max_model_len: int
    stats: EngineStats
    async_scheduling: bool
    prefill_buckets: set[int]
    _spec_tokens = 0  # the last verification step's speculating positions (statistics)
    structured: StructuredOutputManager
    #: Async scheduling with structured-output rows: read step N inside step N+1's bitmask fill, after N+1's
    #: forward is launched (True), or before scheduling N+1 (False: no overlap of the read with the forward).
    structured_early_read: bool = True

    def _run_step(self) -> None:
        """One step under the lock (``step()``): outputs land in ``_outputs``.

        A step that raises fails only the requests it concerns: the rows whose sampling raised (each row is
        retried alone to find them), else every request of the step; they end with ``"error"`` (their blocks
        freed). The step's other sequences are rolled back (:meth:`_recover`) and run again, so the engine
        stays usable. A ``BaseException`` (``KeyboardInterrupt``) rolls the step back, fails nothing, and
        propagates."""
        self._apply_aborts()
        self._current = None
        was_idle = self._inflight is None  # else the step reads the launched one: progress
        try:
            scheduled = self._step_async() if self.async_scheduling else self._step_sync()
            if was_idle and not scheduled:
                self._check_progress()
        except Exception as exc:
            self._recover(exc)
            if isinstance(exc, EngineDeadError):  # e.g. a tensor-parallel worker died: no step can run again
                raise
        except BaseException as exc:
            self._recover(exc)
            raise
        finally:
            self._current = self._launching = None
            self._apply_aborts()

    def _step_async(self) -> bool:
        """Schedule and launch step N+1, then read step N's ids while N+1 runs on the device; returns whether
        N+1 scheduled anything.

        N+1's sequences whose last token is N's pending draw get its id by a gather on the device (no host
        synchronization). Reading N may end sequences (stop ids, EOS, length) that N+1 already computes: their
        extra token is dropped, their blocks freed (writes still queued on the stream land before any later
        step reuses them); likewise a stop string the front end finds in N's tokens (its abort comes before
        N+2 is scheduled). A step whose pending sequences have penalties reads N first (penalties need the
        tokens), and so does nothing else: the tokens are the same as :meth:`_step_sync`'s. A step with
        structured-output rows reads N inside its deferred bitmask fill, after N+1's forward is launched and
        before N+1's draw (the grammar matchers need N's tokens; the fill overlaps N+1's forward)."""
        prev = self._inflight
        t0 = time.perf_counter()
        appended = 0
        if prev is not None and any(self._needs_known_tokens(s) for s in prev.sampled if not s.finished):
            appended = self._read(prev)[1]
            prev = self._inflight = None
        out = self.scheduler.schedule()
        chunks = self._current = self.scheduler.scheduled if out.seq_ids else []
        t1 = time.perf_counter()
        launched = early = None
        if chunks:
            sampled = self._launching = [s for s, n in chunks if s.num_computed_tokens + n >= s.num_tokens]
            early = None if prev is None else _EarlyRead(self, prev)
            # structured rows: their bitmask is filled after N+1's forward is launched, N read first (early)
            out.sampling.grammar_bitmask = self.structured.bitmask(sampled, before=early)
            launched = InFlight(sampled, self.executor.execute_model(out), self.scheduler.prompt_logprobs)
        t2 = time.perf_counter()
        t3 = t2
        if launched is not None and self._speculating(chunks):
            # verification decides how many tokens each speculating row gains: this step is read at once
            if prev is not None:  # read already when a structured row's bitmask fill ran (early)
                appended += (
                    early.result if early is not None and early.result is not None else self._read(prev)
                )[1]
            self._inflight = launched
            self.scheduler.after_forward(chunks)
            t3, n = self._read(launched)
            self._inflight = None
            self._verified(chunks)
            self._finish_step(chunks, appended + n, (t0, t1, t2, t3, time.perf_counter()))
            return True
        if prev is not None:
            t3, n = early.result if early is not None and early.result is not None else self._read(prev)
            appended += n
        self._inflight = launched
        if chunks:
            self.scheduler.after_forward(chunks)  # after the read: the blocks it fills hold known tokens only
            for j, seq in enumerate(launched.sampled):
                if not seq.finished:
                    seq.pending_index = j
                    seq.length_capped = self._length_reached(seq)  # counts the pending token just set
        self._finish_step(chunks, appended, (t0, t1, t2, t3, time.perf_counter()))
        return bool(chunks)

    def _needs_known_tokens(self, seq: Sequence) -> bool:
        """Whether scheduling ``seq``'s next step needs its pending token's id on the host first (async
        scheduling then reads the launched step before scheduling the next). Penalties do not: their token
        counts live on the worker's device and count the pending token there (``worker/penalty_state.py``).
        Multi-token bad words do (a word's last token is banned after its other tokens), and so does
        speculative decoding (drafts follow the last token; the scheduler proposes only for sequences with
        none pending). Structured-output rows need them too, but only for their bitmask, which is filled after
        the next forward is launched: :meth:`_step_async` reads the step there (:class:`_EarlyRead`), unless
        ``structured_early_read`` is off (then they are read here, before scheduling)."""
        p = seq.params
        spec = self.scheduler.spec
        return (
            any(len(w) > 1 for w in p.bad_words_token_ids or ())
            or (p.structured_outputs is not None and not EngineLoop.structured_early_read)
            or (spec is not None and spec.eligible(p))
        )

    @staticmethod
    def _speculating(chunks: list[tuple[Sequence, int]]) -> bool:
        """Whether a scheduled step verifies drafts (some chunk has ``spec_token_ids``)."""
        return any(s.spec_token_ids is not None for s, _ in chunks)

    def _verified(self, chunks: list[tuple[Sequence, int]]) -> None:
        """After a verification step's tokens were appended: its speculating rows count only the accepted
        positions as computed (:meth:`Scheduler.after_verify`); their positions count as decode tokens in the
        step's statistics."""
        self._spec_tokens = sum(n for s, n in chunks if s.spec_token_ids is not None)
        self.scheduler.after_verify(chunks)

    def _record_spec(self, seqs: list[Sequence], new_ids: list[list[int]]) -> None:
        """Count each speculating row's drafts and accepted drafts (its new tokens minus the one the target
        drew), before :meth:`_append` may cut them at a stop."""
        spec = self.scheduler.spec
        if spec is None:
            return
        for seq, toks in zip(seqs, new_ids, strict=True):
            if seq.spec_token_ids is not None and not seq.finished:
                spec.record(seq, len(seq.spec_token_ids), len(toks) - 1)

    def _read(self, prev: InFlight) -> tuple[float, int]:
        """Wait for ``prev``'s sampled ids and append them (stop checks); sequences that ended meanwhile (an
        abort) are skipped. Returns the time the ids arrived (``time.perf_counter``) and how many were
        appended."""
        res = prev.result.get_output()
        t = time.perf_counter()
        for seq in prev.sampled:
            seq.pending_index, seq.length_capped = None, False
        if prev.prompt_logprobs:
            self._fill_prompt_logprobs(prev, res)
        self._record_spec(prev.sampled, res.sampled_token_ids)
        return t, self._append_all(prev.sampled, res.sampled_token_ids, res.logprobs, res.top_logprobs)

    @staticmethod
    def _fill_prompt_logprobs(step: InFlight, res: Any) -> None:
        """Store the prompt logprobs ``step`` computed in their requests' :class:`PromptLogprobs` (before its
        tokens are appended: the first token's output carries them)."""
        for (seq, start), rows in zip(step.prompt_logprobs, res.prompt_logprobs, strict=True):
            if seq.prompt_lp is not None:
                seq.prompt_lp.fill(start, rows)

    def _step_sync(self) -> bool:
        """Schedule, forward, sample and read one step, in that order; returns whether it scheduled
        anything."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        chunks = self._current = self.scheduler.scheduled if out.seq_ids else []
        t1 = t2 = t3 = time.perf_counter()
        appended = 0
        if chunks:
            sampled = self._launching = [s for s, n in chunks if s.num_computed_tokens + n >= s.num_tokens]
            out.sampling.grammar_bitmask = self.structured.bitmask(sampled)
            step = InFlight(sampled, self.executor.execute_model(out), self.scheduler.prompt_logprobs)
            self._inflight = step  # what a failure rolls back
            t2 = time.perf_counter()
            self.scheduler.after_forward(chunks)
            res = step.result.get_output()
            self._inflight = None
            t3 = time.perf_counter()
            if step.prompt_logprobs:
                self._fill_prompt_logprobs(step, res)
            self._record_spec(sampled, res.sampled_token_ids)
            appended = self._append_all(sampled, res.sampled_token_ids, res.logprobs, res.top_logprobs)
            self._verified(chunks)
        self._finish_step(chunks, appended, (t0, t1, t2, t3, time.perf_counter()))
        return bool(chunks)

    def _append_all(
        self,
        seqs: list[Sequence],
        new_ids: list[list[int]],
        lps: list[list[float] | None],
        tops: list[list[dict[int, float]] | None],
    ) -> int:
        """Append each sequence's new tokens (:meth:`_append`), skipping sequences that ended meanwhile;
        returns how many were appended."""
        appended = 0
        for seq, toks, lp, top in zip(seqs, new_ids, lps, tops, strict=True):
            if seq.finished:
                continue
            appended += self._append(seq, toks, lp, top)
        return appended

    def _append(
        self, seq: Sequence, toks: list[int], lps: list[float] | None, tops: list[dict[int, float]] | None
    ) -> int:
        """Append ``toks`` (one or more new tokens) to ``seq`` up to the first that ends it (a stop token, EOS
        after ``min_tokens`` (EOS also under ``ignore_eos`` when it ends a structured-output grammar),
        ``max_tokens`` / ``max_model_len``), queue its :class:`EngineCoreOutput`, and return how many were
        appended. A token the sequence's grammar rejects (a bug) fails its request with ``"error"``,
        loudly."""
        p = seq.params
        reason = stop = None
        k = 0
        for tok in toks:
            seq.token_ids.append(tok)
            k += 1
            if p.structured_outputs is not None:
                try:
                    # ended by its stop token (EOS; ignore_eos too). A grammar that completes on a content
                    # token (llguidance) allows only EOS next: that step ends it as usual.
                    if self.structured.accept(seq, tok) and tok in self.eos:
                        reason = FinishReason.STOP
                except GrammarRejectedError as exc:
                    seq.token_ids.pop()
                    log.error("%s", exc)
                    self._fail(self.requests[seq.request_id], exc)
                    return k - 1
            if lps is not None:
                seq.cumulative_logprob += lps[k - 1]
            if seq.num_output_tokens >= p.min_tokens:
                if p.stop_token_ids and tok in p.stop_token_ids:
                    reason, stop = FinishReason.STOP, tok
                    break
                if not p.ignore_eos and tok in self.eos:
                    reason = FinishReason.STOP
                    break
            if reason is not None:
                break
            if self._length_reached(seq):
                reason = FinishReason.LENGTH
                break
        if k < len(toks):
            toks = toks[:k]
            tops = None if tops is None else tops[:k]
        if reason is not None:
            self.scheduler.finish(seq, reason, stop)
            if p.structured_outputs is not None:
                self.structured.free(seq)
        prompt_lps = None
        if seq.prompt_lp is not None and not seq.prompt_lp.sent:  # the request's first output: all are in
            seq.prompt_lp.sent = True
            prompt_lps = seq.prompt_lp.entries
        queue_time = scheduled = None
        if not seq.queue_time_sent and seq.first_scheduled_time is not None:
            seq.queue_time_sent = True
            scheduled = seq.first_scheduled_time
            queue_time = scheduled - seq.arrival_time
        self._outputs.append(
            EngineCoreOutput(
                seq.request_id,
                seq.index,
                toks,
                tops,
                seq.cumulative_logprob,
                prompt_lps,
                None if reason is None else reason.value,
                stop,
                seq.num_cached_tokens,
                queue_time=queue_time,
                spec_decode=self._spec_counts(seq),
                scheduled_time=scheduled,
            )
        )
        if reason is not None:
            self._forget_if_done(seq.request_id)
        return k

    def _spec_counts(self, seq: Sequence) -> list[int] | None:
        """``seq``'s speculative-decoding counts for its output (None when speculative decoding is off)."""
        if self.scheduler.spec is None:
            return None
        return [seq.num_spec_steps, seq.num_draft_tokens, seq.num_accepted_tokens]

    def _length_reached(self, seq: Sequence) -> bool:
        """``max_tokens`` output tokens or ``max_model_len`` tokens (a pending one included)."""
        return seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len

    def _finish_step(
        self,
        chunks: list[tuple[Sequence, int]],
        appended: int,
        times: tuple[float, float, float, float, float],
    ) -> None:
        """Record the step's statistics (``times``: perf_counter at its start and after schedule, forward,
        sample and append)."""
        st = StepStats()
        st.num_preempted, st.num_seqs, st.num_sampled = len(self.scheduler.preempted), len(chunks), appended
        spec, self._spec_tokens = self._spec_tokens, 0  # verification chunks: decode, not prefill
        st.num_prefill_tokens = sum(n for _, n in chunks if n > 1) - spec
        st.num_decode_tokens = sum(n for _, n in chunks if n == 1) + spec
        if st.num_prefill_tokens:  # the shape buckets kernel_report() covers
            self.prefill_buckets.add(1 << (st.num_prefill_tokens - 1).bit_length())
        st.schedule_s, st.forward_s, st.sample_s, st.detokenize_s = (
            b - a for a, b in itertools.pairwise(times)
        )
        self.stats.record(st, self.kv.usage(), self.kv.stats().hit_rate)
        self.stats.preemptions = self.scheduler.num_preemptions
        self.stats.cascade_steps = self.executor.cascade_steps
        self.stats.cascade_saved_tokens = self.executor.cascade_saved_tokens
        if self.scheduler.spec is not None:
            self.stats.spec_decode = self.scheduler.spec.as_dict()


class _EarlyRead:
    """Reads a launched step ``prev`` for :meth:`EngineLoop._step_async` when the next step's grammar bitmask
    fill runs (called once; ``result``: what :meth:`EngineLoop._read` returned, None until then)."""

    def __init__(self, loop: EngineLoop, prev: InFlight) -> None:
        self.loop, self.prev = loop, prev
        self.result: tuple[float, int] | None = None

    def __call__(self) -> None:
        if self.result is None:
            self.result = self.loop._read(self.prev)
