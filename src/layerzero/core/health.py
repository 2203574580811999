"""Backend health: consecutive-failure counters and a circuit breaker per backend.

State machine (Nygard, *Release It!*, "Circuit Breaker"; the same shape as Hystrix / resilience4j):

* ``CLOSED``: usable. A failure adds to the consecutive-failure count; a success resets it to 0.
  When the count reaches ``failure_threshold`` the breaker OPENs.
* ``OPEN``: not usable, for ``cooldown_s`` seconds from when it opened. Outcomes reported while OPEN
  (calls already in flight) are counted (failures) or ignored (successes); they do not move the state
  or extend the cooldown.
* ``HALF_OPEN``: the cooldown has elapsed (checked lazily by every query): the backend is usable again
  for **one trial**: the first outcome recorded decides. A success CLOSEs it (count reset to 0); a
  failure re-OPENs it at once, with a fresh cooldown, whatever the threshold.

:meth:`HealthTracker.usable` is a pure query (it claims nothing), so a candidate that is scored but not
chosen cannot leave a trial claimed forever; the trial is the next call that actually runs.

``on_change(backend_id, new_state)`` is called after the lock is released, once per transition
(OPEN->HALF_OPEN included, fired by whichever query notices it), so dispatch can invalidate cached
selections. Notifications from different threads may arrive out of order: re-read :meth:`state` when
order matters. An exception raised by ``on_change`` is logged at ERROR and not propagated (it must not
hide the kernel error being recorded).
"""

from __future__ import annotations

import enum
import logging
import math
import numbers
import threading
import time
from collections.abc import Callable
from typing import Any

from layerzero.core.errors import ConfigurationError, InvalidInputError, expected_got
from layerzero.core.reasons import Reason, ReasonCode

__all__ = ["BreakerState", "HealthTracker"]

logger = logging.getLogger(__name__)

_MAX_ERROR_CHARS = 500


class BreakerState(str, enum.Enum):
    """Circuit-breaker state of one backend. The value is the wire format (doctor JSON, logs)."""

    CLOSED = "CLOSED"
    OPEN = "OPEN"
    HALF_OPEN = "HALF_OPEN"


class _Entry:
    """Mutable per-backend record; only touched under the tracker's lock (``state`` read lock-free)."""

    __slots__ = ("state", "failures", "last_error", "opened_at")

    def __init__(self) -> None:
        self.state = BreakerState.CLOSED
        self.failures = 0
        self.last_error: str | None = None
        self.opened_at: float | None = None


_Change = tuple[str, BreakerState]


class HealthTracker:
    """Per-backend failure counters with a circuit breaker (see the module docstring).

    Args:
        failure_threshold: consecutive failures that OPEN a CLOSED breaker (int >= 1).
        cooldown_s: seconds an OPEN breaker waits before HALF_OPEN (finite, >= 0), in ``clock`` units.
        clock: monotonic time source, seconds (tests pass a fake clock).
        on_change: called as ``on_change(backend_id, new_state)`` outside the lock on every transition.

    Raises:
        ConfigurationError: a bad threshold, cooldown, clock or callback.

    Thread-safe: one lock guards every transition. :meth:`usable` takes no lock for a backend that has
    never failed, or whose breaker is CLOSED.

    >>> t = HealthTracker(failure_threshold=2, cooldown_s=10.0, clock=lambda: 0.0)
    >>> t.record_failure("flash_attn", "CUDA error"), t.record_failure("flash_attn", "CUDA error")
    (<BreakerState.CLOSED: 'CLOSED'>, <BreakerState.OPEN: 'OPEN'>)
    >>> t.usable("flash_attn"), t.usable("torch_sdpa")
    (False, True)
    """

    def __init__(
        self,
        failure_threshold: int = 3,
        cooldown_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[str, BreakerState], None] | None = None,
    ) -> None:
        if (
            isinstance(failure_threshold, bool)
            or not isinstance(failure_threshold, int)
            or failure_threshold < 1
        ):
            raise ConfigurationError(
                expected_got("HealthTracker(failure_threshold)", "an int >= 1", repr(failure_threshold))
            )
        if (
            isinstance(cooldown_s, bool)
            or not isinstance(cooldown_s, numbers.Real)
            or not math.isfinite(cooldown_s)
            or cooldown_s < 0
        ):
            raise ConfigurationError(
                expected_got("HealthTracker(cooldown_s)", "a finite number of seconds >= 0", repr(cooldown_s))
            )
        if not callable(clock):
            raise ConfigurationError(
                expected_got(
                    "HealthTracker(clock)",
                    "a callable returning seconds",
                    type(clock).__name__,
                    "Pass time.monotonic.",
                )
            )
        if on_change is not None and not callable(on_change):
            raise ConfigurationError(
                expected_got("HealthTracker(on_change)", "a callable or None", type(on_change).__name__)
            )
        self._threshold = failure_threshold
        self._cooldown = float(cooldown_s)
        self._clock = clock
        self._on_change = on_change
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}

    @property
    def failure_threshold(self) -> int:
        """Consecutive failures that open a CLOSED breaker."""
        return self._threshold

    @property
    def cooldown_s(self) -> float:
        """Seconds an OPEN breaker waits before it lets one trial through."""
        return self._cooldown

    # ------------------------------------------------------------------------------ internals
    def _advance(self, backend_id: str, e: _Entry, now: float, changes: list[_Change]) -> None:
        """OPEN -> HALF_OPEN once the cooldown has elapsed (lock held)."""
        if e.state is BreakerState.OPEN and e.opened_at is not None and now - e.opened_at >= self._cooldown:
            e.state = BreakerState.HALF_OPEN
            changes.append((backend_id, BreakerState.HALF_OPEN))

    def _notify(self, changes: list[_Change]) -> None:
        if self._on_change is None:
            return
        for backend_id, new_state in changes:
            try:
                self._on_change(backend_id, new_state)
            except Exception:
                logger.error(
                    "health on_change callback raised for backend %r -> %s; ignored",
                    backend_id,
                    new_state.value,
                    exc_info=True,
                )

    # ---------------------------------------------------------------------------------- API
    def record_failure(self, backend_id: str, error: BaseException | str) -> BreakerState:
        """Record that a kernel of ``backend_id`` raised ``error``; return the breaker's new state.

        Raises:
            InvalidInputError: ``backend_id`` is not a non-empty str, or ``error`` is neither an
                exception nor a str.
        """
        _check_backend(backend_id)
        if isinstance(error, BaseException):
            text = f"{type(error).__name__}: {error}"
        elif isinstance(error, str):
            text = error
        else:
            raise InvalidInputError(
                expected_got("record_failure(error)", "an exception or a str", type(error).__name__)
            )
        text = text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 3] + "..."
        changes: list[_Change] = []
        with self._lock:
            now = self._clock()
            e = self._entries.get(backend_id)
            if e is None:
                e = self._entries[backend_id] = _Entry()
            self._advance(backend_id, e, now, changes)
            e.failures += 1
            e.last_error = text
            if e.state is BreakerState.HALF_OPEN or (
                e.state is BreakerState.CLOSED and e.failures >= self._threshold
            ):
                e.state, e.opened_at = BreakerState.OPEN, now
                changes.append((backend_id, BreakerState.OPEN))
            state, failures = e.state, e.failures
        level = logging.WARNING if changes else logging.INFO
        logger.log(
            level,
            "backend %r: consecutive failure %d recorded (%s); breaker %s",
            backend_id,
            failures,
            text,
            state.value,
        )
        self._notify(changes)
        return state

    def record_success(self, backend_id: str) -> BreakerState:
        """Record a successful run of a ``backend_id`` kernel; return the breaker's new state.

        CLOSED: the consecutive-failure count is reset. HALF_OPEN: the breaker CLOSEs. OPEN: ignored.

        Raises:
            InvalidInputError: ``backend_id`` is not a non-empty str.
        """
        _check_backend(backend_id)
        if backend_id not in self._entries:  # never failed: nothing to reset, no lock
            return BreakerState.CLOSED
        changes: list[_Change] = []
        with self._lock:
            e = self._entries.get(backend_id)
            if e is None:
                return BreakerState.CLOSED
            self._advance(backend_id, e, self._clock(), changes)
            if e.state is BreakerState.HALF_OPEN:
                e.state, e.opened_at = BreakerState.CLOSED, None
                changes.append((backend_id, BreakerState.CLOSED))
            if e.state is BreakerState.CLOSED:
                e.failures = 0
            state = e.state
        self._notify(changes)
        return state

    def state(self, backend_id: str) -> BreakerState:
        """The breaker's state now (an OPEN breaker whose cooldown has elapsed becomes HALF_OPEN).

        Raises:
            InvalidInputError: ``backend_id`` is not a non-empty str.
        """
        _check_backend(backend_id)
        if backend_id not in self._entries:
            return BreakerState.CLOSED
        changes: list[_Change] = []
        with self._lock:
            e = self._entries.get(backend_id)
            if e is None:
                return BreakerState.CLOSED
            self._advance(backend_id, e, self._clock(), changes)
            state = e.state
        self._notify(changes)
        return state

    def usable(self, backend_id: str) -> bool:
        """Whether selection may pick kernels of ``backend_id`` now (CLOSED or HALF_OPEN).

        Lock-free for a backend that never failed or whose breaker is CLOSED.
        """
        e = self._entries.get(backend_id)
        if e is None or e.state is BreakerState.CLOSED:
            return True
        return self.state(backend_id) is not BreakerState.OPEN

    def reason(self, backend_id: str) -> Reason | None:
        """A ``BACKEND_UNHEALTHY`` :class:`Reason` while the breaker is OPEN, else ``None``.

        The message gives the consecutive-failure count, the last error's text and the seconds until
        the next trial.

        Raises:
            InvalidInputError: ``backend_id`` is not a non-empty str.
        """
        if self.usable(_check_backend(backend_id)):
            return None
        with self._lock:
            e = self._entries.get(backend_id)
            if e is None or e.state is not BreakerState.OPEN or e.opened_at is None:
                return None
            failures, last_error = e.failures, e.last_error
            retry_in = max(0.0, e.opened_at + self._cooldown - self._clock())
        return Reason(
            ReasonCode.BACKEND_UNHEALTHY,
            f"backend {backend_id!r} is disabled by its circuit breaker after {failures} "
            f"consecutive failure(s); last error: {last_error}; retry in {retry_in:.1f} s. "
            f"Fix the error above, or reset the breaker (HealthTracker.reset({backend_id!r})).",
        )

    def poll(self) -> list[str]:
        """Move every OPEN breaker whose cooldown elapsed to HALF_OPEN (firing ``on_change``).

        Returns:
            The backend ids that changed. Call it on cache misses or from a timer, so a cached
            selection that excluded a backend is invalidated when its trial becomes due.
        """
        changes: list[_Change] = []
        with self._lock:
            now = self._clock()
            for backend_id, e in self._entries.items():
                self._advance(backend_id, e, now, changes)
        self._notify(changes)
        return [backend_id for backend_id, _ in changes]

    def next_retry_at(self) -> float | None:
        """Earliest ``clock()`` time at which an OPEN breaker becomes HALF_OPEN; ``None`` if none is OPEN."""
        with self._lock:
            due = [
                e.opened_at + self._cooldown
                for e in self._entries.values()
                if e.state is BreakerState.OPEN and e.opened_at is not None
            ]
        return min(due, default=None)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Every backend that ever failed: ``{backend_id: {...}}``, JSON-ready, for ``doctor``.

        Keys: ``state`` (str, a :class:`BreakerState` value), ``failures`` (consecutive, int),
        ``last_error`` (str | None), ``opened_at`` (``clock()`` seconds | None), ``retry_in_s``
        (seconds until the trial while OPEN, else None).
        """
        changes: list[_Change] = []
        with self._lock:
            now = self._clock()
            out: dict[str, dict[str, Any]] = {}
            for backend_id, e in self._entries.items():
                self._advance(backend_id, e, now, changes)
                retry = (
                    max(0.0, e.opened_at + self._cooldown - now)
                    if e.state is BreakerState.OPEN and e.opened_at is not None
                    else None
                )
                out[backend_id] = {
                    "state": e.state.value,
                    "failures": e.failures,
                    "last_error": e.last_error,
                    "opened_at": e.opened_at,
                    "retry_in_s": retry,
                }
        self._notify(changes)
        return out

    def reset(self, backend_id: str | None = None) -> None:
        """Forget one backend's history (or every backend's); non-CLOSED breakers report CLOSED.

        Raises:
            InvalidInputError: ``backend_id`` is given but not a non-empty str.
        """
        with self._lock:
            if backend_id is None:
                dropped = list(self._entries.items())
                self._entries.clear()
            else:
                e = self._entries.pop(_check_backend(backend_id), None)
                dropped = [] if e is None else [(backend_id, e)]
        self._notify([(b, BreakerState.CLOSED) for b, e in dropped if e.state is not BreakerState.CLOSED])


def _check_backend(backend_id: Any) -> str:
    if not isinstance(backend_id, str) or not backend_id:
        raise InvalidInputError(
            expected_got("backend_id", "a non-empty str such as 'flash_attn'", repr(backend_id))
        )
    return backend_id
