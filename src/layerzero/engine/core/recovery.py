"""Failure recovery of the engine core's step loop: :class:`StepRecovery`, the part of
:class:`~layerzero.engine.core.engine_core.EngineCore` that ends requests (queued aborts, failures) and rolls
back a step that raised, so one bad request or a defect fails only the requests it concerns and the engine
stays usable.

A mixin (the step loop inherits it) rather than functions: the step loop calls these as methods of the core
and they read and change its scheduler, requests and in-flight step."""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any

from ..metrics import EngineStats
from ..worker.sampler import SamplingError
from .messages import EngineCoreAbort, EngineCoreOutput
from .request import InFlight, Request
from .sched.scheduler import Scheduler
from .sequence import FinishReason, Sequence, SequenceStatus

__all__ = ["StepRecovery"]

log = logging.getLogger("layerzero.engine")

_REASONS = {"abort": FinishReason.ABORT, "stop": FinishReason.STOP}


class StepRecovery:
    """Ending requests and undoing a failed step, for the engine core (which sets the attributes below in its
    ``__init__``); every method expects the caller to hold ``lock`` unless it says otherwise."""

    requests: dict[str, Request]
    scheduler: Scheduler
    executor: Any
    stats: EngineStats
    lock: threading.RLock
    _aborts: collections.deque[EngineCoreAbort]
    _outputs: list[EngineCoreOutput]
    _inflight: InFlight | None
    _current: list[tuple[Sequence, int]] | None
    _launching: list[Sequence] | None

    def _try_apply_aborts(self) -> None:
        """Apply the queued aborts now unless another thread holds the lock (its step's end applies them)."""
        if self._aborts and self.lock.acquire(blocking=False):
            try:
                self._apply_aborts()
            finally:
                self.lock.release()

    def _apply_aborts(self) -> None:
        """Apply the queued :class:`EngineCoreAbort` s (unknown or finished ids ignored); the caller holds the
        lock."""
        while self._aborts:
            a = self._aborts.popleft()
            req = self.requests.get(a.request_id)
            if req is None:
                continue
            reason = _REASONS.get(a.reason, FinishReason.ABORT)
            seqs = req.seqs if a.index is None else [s for s in req.seqs if s.index == a.index]
            for seq in seqs:
                self._end_seq(seq, reason, a.stop_reason)
            self._forget_if_done(a.request_id)

    def _end_seq(
        self, seq: Sequence, reason: FinishReason, stop: int | str | None = None, error: str | None = None
    ) -> None:
        """Finish ``seq`` (unless it ended already) with ``reason`` (its blocks freed; a pending token
        dropped) and queue its last output (no new tokens)."""
        if seq.finished:
            return
        seq.pending_index, seq.length_capped = None, False
        self.scheduler.finish(seq, reason, stop)
        self._outputs.append(
            EngineCoreOutput(
                seq.request_id,
                seq.index,
                [],
                None,
                seq.cumulative_logprob,
                None,  # prompt_logprobs
                reason.value,
                stop,
                seq.num_cached_tokens,
                error,
            )
        )

    def _fail(self, req: Request, exc: BaseException) -> None:
        """``req`` failed inside a step: it ends with finish reason ``"error"`` and ``error`` says why."""
        req.error = f"{type(exc).__name__}: {exc}"
        for seq in req.seqs:
            self._end_seq(seq, FinishReason.ERROR, error=req.error)
        self._forget_if_done(req.request_id)

    def _recover(self, exc: BaseException) -> list[Request]:
        """Undo a step that raised ``exc`` and fail the requests it blames; returns the failed requests.

        Every sequence of the step (and of the launched step whose tokens were still pending) drops its
        pending token and, if it holds blocks, is preempted: its known tokens are computed again, as after a
        preemption (seeded and greedy sequences give the same tokens). Blame: the rows a ``SamplingError``
        names when the sampler found the failing rows, none for a ``BaseException``, else every sequence of
        the step (or, when the scheduler itself raised, every running one)."""
        out, prev, launching = self._current, self._inflight, self._launching
        self._inflight = None
        self.executor.reset()
        step = [s for s, _ in out] if out is not None else list(self.scheduler.running)
        involved = list(dict.fromkeys([*(prev.sampled if prev is not None else ()), *step]))
        if not isinstance(exc, Exception):
            blamed: list[Sequence] = []
        elif isinstance(exc, SamplingError) and launching is not None:
            blamed = [launching[i] for i in exc.rows]
        else:
            blamed = step
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
                self._end_seq(seq, FinishReason.ERROR, error=str(err))

    def _forget_if_done(self, request_id: str) -> None:
        """Drop a request whose completions all ended (its id may be reused); counts it finished."""
        req = self.requests.get(request_id)
        if req is not None and req.finished:
            del self.requests[request_id]
            self.stats.finished_requests += 1
