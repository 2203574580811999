"""HealthTracker: the circuit-breaker state machine worked by hand with a fake clock, and threads."""

from __future__ import annotations

import logging
import math
import threading

import pytest

from layerzero.core.errors import ConfigurationError, InvalidInputError
from layerzero.core.health import BreakerState, HealthTracker
from layerzero.core.reasons import ReasonCode

pytestmark = pytest.mark.unit

CLOSED, OPEN, HALF = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def changes():
    return []


@pytest.fixture
def tracker(clock, changes):
    return HealthTracker(
        failure_threshold=3, cooldown_s=10.0, clock=clock, on_change=lambda b, s: changes.append((b, s))
    )


def test_full_state_machine_by_hand(tracker, clock, changes):
    b = "flash_attn"
    assert tracker.state(b) is CLOSED and tracker.usable(b) and tracker.reason(b) is None
    # two failures, then a success resets the consecutive count
    assert tracker.record_failure(b, RuntimeError("boom")) is CLOSED
    assert tracker.record_failure(b, RuntimeError("boom")) is CLOSED
    assert tracker.record_success(b) is CLOSED
    assert tracker.snapshot()[b]["failures"] == 0
    # three consecutive failures at t=0 open it
    assert tracker.record_failure(b, "e1") is CLOSED
    assert tracker.record_failure(b, "e2") is CLOSED
    assert changes == []
    assert tracker.record_failure(b, RuntimeError("CUDA error: illegal address")) is OPEN
    assert changes == [(b, OPEN)]
    assert not tracker.usable(b)
    r = tracker.reason(b)
    assert r.code is ReasonCode.BACKEND_UNHEALTHY
    assert "after 3 consecutive failure(s)" in r.message
    assert "last error: RuntimeError: CUDA error: illegal address" in r.message
    assert "retry in 10.0 s" in r.message
    # while OPEN: time passes, a stale success is ignored, a stale failure counts but keeps the cooldown
    clock.t = 4.0
    assert "retry in 6.0 s" in tracker.reason(b).message
    assert tracker.record_success(b) is OPEN
    clock.t = 5.0
    assert tracker.record_failure(b, "late") is OPEN
    assert tracker.snapshot()[b] == {
        "state": "OPEN",
        "failures": 4,
        "last_error": "late",
        "opened_at": 0.0,
        "retry_in_s": 5.0,
    }
    clock.t = 9.999
    assert tracker.state(b) is OPEN
    # cooldown elapsed: HALF_OPEN, usable for one trial, no reason
    clock.t = 10.0
    assert tracker.usable(b) and tracker.state(b) is HALF
    assert tracker.reason(b) is None
    assert changes == [(b, OPEN), (b, HALF)]
    # the trial fails: OPEN again at once, fresh cooldown from t=10
    clock.t = 11.0
    assert tracker.record_failure(b, "trial failed") is OPEN
    assert tracker.snapshot()[b]["opened_at"] == 11.0
    clock.t = 20.9
    assert tracker.state(b) is OPEN and "retry in 0.1 s" in tracker.reason(b).message
    # next trial succeeds: CLOSED, count reset
    clock.t = 21.0
    assert tracker.state(b) is HALF
    assert tracker.record_success(b) is CLOSED
    assert tracker.usable(b) and tracker.reason(b) is None
    assert tracker.snapshot()[b] == {
        "state": "CLOSED",
        "failures": 0,
        "last_error": "trial failed",
        "opened_at": None,
        "retry_in_s": None,
    }
    assert changes == [(b, OPEN), (b, HALF), (b, OPEN), (b, HALF), (b, CLOSED)]
    # after closing, it again takes 3 consecutive failures to open
    assert [tracker.record_failure(b, "x") for _ in range(3)] == [CLOSED, CLOSED, OPEN]


def test_due_trial_is_noticed_by_record_failure_itself(tracker, clock, changes):
    for _ in range(3):
        tracker.record_failure("b", "x")
    clock.t = 30.0  # nobody queried in between
    assert tracker.record_failure("b", "y") is OPEN
    assert changes == [("b", OPEN), ("b", HALF), ("b", OPEN)]
    assert tracker.snapshot()["b"]["opened_at"] == 30.0


def test_threshold_one_and_zero_cooldown(clock):
    t = HealthTracker(failure_threshold=1, cooldown_s=0.0, clock=clock)
    assert t.record_failure("b", "x") is OPEN
    assert t.state("b") is HALF  # zero cooldown: the trial is due at once
    assert t.record_success("b") is CLOSED


def test_backends_are_independent(tracker):
    for _ in range(3):
        tracker.record_failure("a", "x")
    assert not tracker.usable("a")
    assert tracker.usable("b") and tracker.state("b") is CLOSED and tracker.reason("b") is None
    assert tracker.record_success("b") is CLOSED
    assert set(tracker.snapshot()) == {"a"}


def test_reset_one_and_all(tracker, changes):
    for b in ("a", "c"):
        for _ in range(3):
            tracker.record_failure(b, "x")
    tracker.record_failure("d", "x")  # CLOSED with one failure: no notification on reset
    changes.clear()
    tracker.reset("a")
    assert tracker.usable("a") and "a" not in tracker.snapshot()
    assert changes == [("a", CLOSED)]
    tracker.reset()
    assert tracker.snapshot() == {}
    assert changes == [("a", CLOSED), ("c", CLOSED)]
    tracker.reset("never-seen")
    assert len(changes) == 2


def test_poll_and_next_retry_at(tracker, clock, changes):
    assert tracker.next_retry_at() is None and tracker.poll() == []
    for _ in range(3):
        tracker.record_failure("a", "x")
    clock.t = 4.0
    for _ in range(3):
        tracker.record_failure("b", "x")
    assert tracker.next_retry_at() == 10.0
    clock.t = 12.0
    assert tracker.poll() == ["a"]
    assert tracker.next_retry_at() == 14.0
    clock.t = 14.0
    assert tracker.poll() == ["b"]
    assert tracker.next_retry_at() is None
    assert changes[-2:] == [("a", HALF), ("b", HALF)]


def test_on_change_runs_outside_the_lock(clock):
    seen = []
    t = None

    def on_change(backend, state):
        seen.append((backend, state, t.state(backend), t.usable(backend)))  # would deadlock under the lock

    t = HealthTracker(failure_threshold=1, cooldown_s=5.0, clock=clock, on_change=on_change)
    worker = threading.Thread(target=t.record_failure, args=("b", "x"), daemon=True)
    worker.start()
    worker.join(timeout=5)
    assert not worker.is_alive(), "on_change was called while the lock was held"
    assert seen == [("b", OPEN, OPEN, False)]


def test_on_change_errors_are_logged_not_raised(clock, caplog):
    def bad(backend, state):
        raise KeyError("cache gone")

    t = HealthTracker(failure_threshold=1, clock=clock, on_change=bad)
    with caplog.at_level(logging.ERROR, logger="layerzero.core.health"):
        assert t.record_failure("b", "x") is OPEN
    assert "on_change callback raised" in caplog.text and "cache gone" in caplog.text
    assert not t.usable("b")


def test_usable_takes_no_lock_for_healthy_backends(tracker):
    class Exploding:
        def __enter__(self):
            raise AssertionError("lock taken on the fast path")

        def __exit__(self, *a):
            return False

    tracker.record_failure("once", "x")  # failed once, still CLOSED
    tracker._lock = Exploding()
    assert tracker.usable("never-failed")
    assert tracker.usable("once")
    assert tracker.record_success("never-failed") is CLOSED
    with pytest.raises(AssertionError, match="fast path"):
        tracker.state("once")  # the slow path does lock: proves the probe works


def test_long_error_text_is_truncated(tracker):
    tracker.record_failure("b", ValueError("x" * 5000))
    text = tracker.snapshot()["b"]["last_error"]
    assert len(text) == 500 and text.startswith("ValueError: xxx") and text.endswith("...")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"failure_threshold": 0}, r"failure_threshold.*expected an int >= 1, got 0"),
        ({"failure_threshold": 2.5}, r"failure_threshold.*got 2.5"),
        ({"failure_threshold": True}, r"failure_threshold.*got True"),
        ({"cooldown_s": -1.0}, r"cooldown_s.*>= 0, got -1.0"),
        ({"cooldown_s": math.nan}, r"cooldown_s.*got nan"),
        ({"cooldown_s": math.inf}, r"cooldown_s.*got inf"),
        ({"clock": 3.0}, r"clock.*expected a callable"),
        ({"on_change": "cb"}, r"on_change.*expected a callable or None, got str"),
    ],
)
def test_bad_configuration(kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        HealthTracker(**kwargs)


@pytest.mark.parametrize(
    "call",
    [
        lambda t: t.record_failure("", "x"),
        lambda t: t.record_failure(None, "x"),
        lambda t: t.record_success(3),
        lambda t: t.state(""),
        lambda t: t.reason(None),
        lambda t: t.reset(""),
    ],
)
def test_bad_backend_id(tracker, call):
    with pytest.raises(InvalidInputError, match="backend_id: expected a non-empty str"):
        call(tracker)


def test_bad_error_argument(tracker):
    with pytest.raises(InvalidInputError, match="expected an exception or a str, got int"):
        tracker.record_failure("b", 404)


# ------------------------------------------------------------------------------------ threads
def _run_threads(n: int, target) -> None:
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def wrapped(i: int) -> None:
        try:
            barrier.wait()
            target(i)
        except BaseException as exc:  # noqa: BLE001 - collected for the main thread
            errors.append(exc)

    threads = [threading.Thread(target=wrapped, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    assert not errors, errors


def test_many_threads_count_every_failure_and_open_once(clock, changes):
    t = HealthTracker(
        failure_threshold=50, cooldown_s=100.0, clock=clock, on_change=lambda b, s: changes.append((b, s))
    )

    def work(i: int) -> None:
        for _ in range(250):
            t.record_failure("shared", f"thread {i}")
            t.record_failure(f"own{i}", "x")
            t.usable("shared")

    _run_threads(8, work)
    snap = t.snapshot()
    assert snap["shared"]["failures"] == 8 * 250 and snap["shared"]["state"] == "OPEN"
    assert all(snap[f"own{i}"]["failures"] == 250 for i in range(8))
    assert sorted(changes) == sorted([("shared", OPEN)] + [(f"own{i}", OPEN) for i in range(8)])


def test_concurrent_trial_failures_reopen_exactly_once(tracker, clock, changes):
    for _ in range(3):
        tracker.record_failure("b", "x")
    clock.t = 10.0  # trial due; every thread's failure races for the HALF_OPEN -> OPEN transition
    _run_threads(8, lambda i: tracker.record_failure("b", f"t{i}"))
    assert changes == [("b", OPEN), ("b", HALF), ("b", OPEN)]
    assert tracker.snapshot()["b"]["failures"] == 3 + 8


def test_mixed_success_and_failure_threads_stay_consistent(clock):
    t = HealthTracker(failure_threshold=3, cooldown_s=0.0, clock=clock)

    def work(i: int) -> None:
        for j in range(300):
            if (i + j) % 3:
                t.record_failure("b", "x")
            else:
                t.record_success("b")
            t.usable("b")
            t.reason("b")

    _run_threads(6, work)
    # zero cooldown: whatever state the race left, one success closes it and clears the count
    assert t.record_success("b") is CLOSED
    assert t.snapshot()["b"]["failures"] == 0 and t.usable("b")
