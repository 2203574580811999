"""Whether anything in the process observes dispatch, for the ops' inlined cache-hit path.

The hottest ops (``lz.attention``, ``lz.rms_norm``, ``lz.rope``) look their exact key up in the hot dict and
call the plan themselves, skipping :meth:`Runtime.run_hot`'s frame and its per-call checks (telemetry,
``lz.trace``) — worth ~1 µs per call on the 2-core AVX2 CI machine, where Python in front of a kernel costs
about twice its standalone time. They may do so only while nobody would miss the call: no telemetry recording,
no ``lz.trace()`` block and no ``lz.dry_run`` anywhere in the process. Each such observer registers here while
it is active (:meth:`DispatchObservers.enter` / :meth:`~DispatchObservers.leave`, counted and thread-safe);
while any is registered, :attr:`DispatchObservers.none` is False and the ops go through ``Runtime.run_hot``,
which counts, times or records per call (per thread or task, as before). Imports nothing of LayerZero (core,
telemetry and planning import it).

Also here: the ``lz.trace()`` block itself (:func:`trace`, :class:`DispatchTrace`, :data:`TRACE`), an observer
that dispatch and its failure handling both record into (``core.dispatch`` re-exports them).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections import Counter
from collections.abc import Iterator

__all__ = ["OBSERVERS", "TRACE", "DispatchObservers", "DispatchTrace", "trace"]


class DispatchObservers:
    """A count of active dispatch observers. ``none`` (a plain attribute, one load on the hot path) is True
    while the count is 0."""

    __slots__ = ("_count", "_lock", "none")

    def __init__(self) -> None:
        self.none = True
        self._count = 0
        self._lock = threading.Lock()

    def enter(self) -> None:
        """Register one observer (from now on the ops take ``Runtime.run_hot``)."""
        with self._lock:
            self._count += 1
            self.none = False

    def leave(self) -> None:
        """Unregister one observer; a ``leave`` without an ``enter`` raises ``RuntimeError`` (a bookkeeping
        bug: the count would go negative and the inlined path would stay off, or turn on under an
        observer)."""
        with self._lock:
            if self._count == 0:
                raise RuntimeError("DispatchObservers.leave() without a matching enter()")
            self._count -= 1
            self.none = self._count == 0

    @property
    def count(self) -> int:
        """Active observers now (a moment's snapshot, for tests)."""
        return self._count


OBSERVERS = DispatchObservers()
"""The process's dispatch observers (telemetry on, ``lz.trace()`` blocks, ``lz.dry_run``)."""


class DispatchTrace:
    """Counts of ``(op, kernel_id)`` dispatched inside an ``lz.trace()`` block (``.counts``), plus the
    fallbacks that happened (``.fallbacks``: ``(op, failed kernel, error text)``)."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self.fallbacks: list[tuple[str, str, str]] = []

    def kernels_for(self, op: str) -> list[str]:
        """Kernel ids that served ``op`` in this block, most used first."""
        return [k for (o, k), _ in self.counts.most_common() if o == op]


TRACE: contextvars.ContextVar[DispatchTrace | None] = contextvars.ContextVar("layerzero_trace", default=None)
"""The innermost ``lz.trace()`` block of this thread/task (None outside any): dispatch counts into it."""


@contextlib.contextmanager
def trace() -> Iterator[DispatchTrace]:
    """Record which kernel served each op call inside the block (this thread/task only); yields a
    :class:`DispatchTrace`. Raises nothing; errors of the ops inside propagate unchanged."""
    t = DispatchTrace()
    OBSERVERS.enter()  # the ops' inlined hot path counts nothing: they take run_hot meanwhile
    token = TRACE.set(t)
    try:
        yield t
    finally:
        TRACE.reset(token)
        OBSERVERS.leave()
