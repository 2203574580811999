"""Whether anything in the process observes dispatch, for the ops' inlined cache-hit path.

The hottest ops (``lz.attention``, ``lz.rms_norm``, ``lz.rope``) look their exact key up in the hot dict and call the plan
themselves, skipping :meth:`Runtime.run_hot`'s frame and its per-call checks (telemetry, ``lz.trace``) — worth
~1 µs per call on the 2-core AVX2 CI machine, where Python in front of a kernel costs about twice its standalone
time. They may do so only while nobody would miss the call: no telemetry recording, no ``lz.trace()`` block and
no ``lz.dry_run`` anywhere in the process. Each such observer registers here while it is active
(:meth:`DispatchObservers.enter` / :meth:`~DispatchObservers.leave`, counted and thread-safe); while any is
registered, :attr:`DispatchObservers.none` is False and the ops go through ``Runtime.run_hot``, which counts,
times or records per call (per thread or task, as before). Imports nothing of LayerZero (core, telemetry and
planning import it).
"""

from __future__ import annotations

import threading

__all__ = ["OBSERVERS", "DispatchObservers"]


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
        """Unregister one observer; a ``leave`` without an ``enter`` raises ``RuntimeError`` (a bookkeeping bug:
        the count would go negative and the inlined path would stay off, or turn on under an observer)."""
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
