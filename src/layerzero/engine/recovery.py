"""Failure recovery of the engine's step loop: :class:`StepRecovery`, the part of
:class:`~layerzero.engine.engine.LLMEngine` that ends requests (queued aborts, failures) and rolls back a step
that raised, so one bad request or a defect fails only the requests it concerns and the engine stays usable.

A mixin (``LLMEngine`` inherits it) rather than functions: the step loop calls these as methods of the engine
and they read and change its scheduler, requests and in-flight step, as before the split."""

from __future__ import annotations

import collections
import logging
import threading

from .request import InFlight, Request
from .sampler import SamplingError
from .scheduler import Scheduler, SchedulerOutput
from .sequence import FinishReason, Sequence, SequenceStatus

__all__ = ["StepRecovery"]

log = logging.getLogger("layerzero.engine")


class StepRecovery:
    """Ending requests and undoing a failed step, for :class:`~layerzero.engine.engine.LLMEngine` (which sets
    the attributes below in its ``__init__``); every method expects the caller to hold ``lock`` unless it
    says otherwise."""

    requests: dict[str, Request]
    scheduler: Scheduler
    lock: threading.RLock
    _aborts: collections.deque[str]
    _inflight: InFlight | None
    _current: SchedulerOutput | None

    def _try_apply_aborts(self) -> None:
        """Apply the queued aborts now unless another thread holds the lock (its step's end applies them)."""
        if self._aborts and self.lock.acquire(blocking=False):
            try:
                self._apply_aborts()
            finally:
                self.lock.release()

    def _apply_aborts(self) -> None:
        """Abort the queued request ids (:meth:`LLMEngine.abort <layerzero.engine.engine.LLMEngine.abort>`);
        the caller holds the lock."""
        while self._aborts:
            req = self.requests.pop(self._aborts.popleft(), None)
            if req is not None:
                self._end(req, FinishReason.ABORT)

    def _end(self, req: Request, reason: FinishReason) -> None:
        """Finish ``req``'s unfinished sequences with ``reason`` (their blocks freed; a pending token
        dropped)."""
        for seq in req.seqs:
            if not seq.finished:
                seq.pending_index, seq.length_capped = None, False
                self.scheduler.finish(seq, reason)

    def _fail(self, req: Request, exc: BaseException) -> None:
        """``req`` failed inside a step: it ends with finish reason ``"error"`` and ``error`` says why."""
        req.error = f"{type(exc).__name__}: {exc}"
        self._end(req, FinishReason.ERROR)

    def _recover(self, exc: BaseException) -> list[Request]:
        """Undo a step that raised ``exc`` and fail the requests it blames; returns the failed requests.

        Every sequence of the step (and of the launched step whose tokens were still pending) drops its
        pending token and, if it holds blocks, is preempted: its known tokens are computed again, as after a
        preemption (seeded and greedy sequences give the same tokens). Blame: ``SamplingError.seqs`` when the
        sampler found the failing rows, none for a ``BaseException``, else every sequence of the step (or,
        when the scheduler itself raised, every running one)."""
        out, prev = self._current, self._inflight
        self._inflight = None
        step = [s for s, _ in out.chunks] if out is not None else list(self.scheduler.running)
        involved = list(dict.fromkeys([*(prev.sampled if prev is not None else ()), *step]))
        if not isinstance(exc, Exception):
            blamed: list[Sequence] = []
        else:
            blamed = exc.seqs if isinstance(exc, SamplingError) else step
        failed = {s.request_id: self.requests[s.request_id] for s in blamed if s.request_id in self.requests}
        cause = (exc.__cause__ or exc) if isinstance(exc, SamplingError) else exc
        for req in failed.values():
            self._fail(req, cause)
        for seq in involved:
            seq.pending_index, seq.length_capped = None, False
            if seq.status is SequenceStatus.RUNNING:
                self.scheduler.preempt(seq)
        if failed:
            log.error(
                "step failed (%s: %s): failed request(s) %s; %d other sequence(s) of the step rolled back",
                type(exc).__name__,
                exc,
                sorted(failed),
                len(involved) - sum(len(r.seqs) for r in failed.values()),
                exc_info=exc,
            )
        return list(failed.values())

    def _check_progress(self) -> None:
        """Never spin (called after a step that scheduled nothing and read nothing): an engine with nothing
        running or in flight must admit a waiting sequence. If it could not (a scheduler defect), the waiting
        requests fail with ``"error"`` instead of every caller looping forever."""
        sched = self.scheduler
        if sched.waiting and not sched.running and self._inflight is None:
            stuck = {s.request_id: self.requests.get(s.request_id) for s in sched.waiting}
            err = RuntimeError(
                f"the scheduler admitted none of {len(sched.waiting)} waiting sequence(s) on an idle "
                "engine (a defect: please report it with the engine's options)"
            )
            log.error("%s; failing request(s) %s", err, sorted(stuck))
            for req in stuck.values():
                if req is not None:
                    self._fail(req, err)
            for seq in list(sched.waiting):  # sequences of requests already forgotten
                sched.finish(seq, FinishReason.ERROR)
