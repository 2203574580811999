"""Unit tests of layerzero.core.cache.SelectionCache: cases worked out by hand.

LRU cases use ``num_shards=1`` so the whole cache is one LRU list; per-shard cases use int keys, whose
hash is the int itself in CPython, so ``shard = key & (num_shards - 1)`` is known in advance.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from layerzero.core.cache import CacheStats, SelectionCache
from layerzero.core.errors import (
    ConfigurationError,
    InvalidInputError,
    LayerZeroError,
    SelectionTimeoutError,
)

pytestmark = pytest.mark.unit

KEY = ("attention", "torch.float16", 2048, (True, False))


class FakeClock:
    """A manual clock in seconds that counts how often it is read."""

    def __init__(self) -> None:
        self.now = 0.0
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        return self.now


def _wait_until(pred, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


# ---------------------------------------------------------------- construction


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_entries": 0}, "max_entries: expected a positive int, got 0"),
        ({"max_entries": -5}, "max_entries: expected a positive int"),
        ({"max_entries": 4.0}, "max_entries: expected a positive int, got 4.0"),
        ({"max_entries": True}, "max_entries: expected a positive int, got True"),
        ({"num_shards": 0}, "num_shards: expected a positive int"),
        ({"num_shards": 6}, r"num_shards: expected a power of two, got 6\. Pass 4 or 8"),
        (
            {"max_entries": 16, "num_shards": 32},
            r"num_shards: expected <= max_entries=16, got 32\. Pass num_shards=16",
        ),
        ({"max_entries": 0, "num_shards": None}, "max_entries: expected a positive int, got 0"),
        ({"ttl_s": 0}, "ttl_s: expected None or a finite number > 0"),
        ({"ttl_s": -1.0}, "ttl_s: expected None or a finite number > 0"),
        ({"ttl_s": float("nan")}, "got nan"),
        ({"ttl_s": float("inf")}, "got inf"),
        ({"ttl_s": "10"}, "got '10'"),
        ({"clock": 3.0}, "clock: expected a callable"),
    ],
)
def test_bad_configuration_raises(kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        SelectionCache(**kwargs)


@pytest.mark.parametrize(
    ("max_entries", "shards"), [(1, 1), (3, 2), (100, 64), (256, 256), (300, 256), (4096, 256)]
)
def test_default_shard_count_is_256_or_the_largest_power_of_two_that_fits(max_entries, shards):
    assert SelectionCache(max_entries=max_entries).num_shards == shards


def test_defaults_and_shard_capacities_sum_to_max_entries():
    cache = SelectionCache()
    assert (cache.max_entries, cache.num_shards, cache.generation, len(cache)) == (4096, 256, 0, 0)
    # 10 entries over 4 shards: 3, 3, 2, 2 (never more than ceil(10 / 4) = 3, total exactly 10).
    small = SelectionCache(max_entries=10, num_shards=4)
    for key in range(40):  # int keys: shard = key & 3, ten keys per shard
        small.put(key, f"v{key}")
    per_shard = [sum(1 for k in range(40) if k & 3 == s and small.get(k) is not None) for s in range(4)]
    assert per_shard == [3, 3, 2, 2]
    assert len(small) == 10


# ---------------------------------------------------------------- get / put / invalidate


def test_hit_miss_and_stats_counted_by_hand():
    cache = SelectionCache(max_entries=8, num_shards=2)
    assert cache.get(KEY) is None  # miss 1
    cache.put(KEY, "plan-a")
    assert cache.get(KEY) == "plan-a"  # hit 1
    assert cache.get(KEY) == "plan-a"  # hit 2
    assert cache.get(("other",)) is None  # miss 2
    assert cache.stats() == CacheStats(hits=2, misses=2, evictions=0, invalidations=0, size=1, generation=0)


def test_invalidate_is_generation_bump_and_entries_go_stale():
    cache = SelectionCache(max_entries=8, num_shards=1)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.invalidate() == 1
    assert cache.generation == 1
    assert cache.get("a") is None and cache.get("b") is None
    assert len(cache) == 0
    cache.put("a", 10)
    assert cache.get("a") == 10
    assert cache.invalidate() == 2
    assert cache.stats().invalidations == 2


def test_put_with_old_generation_is_not_served():
    cache = SelectionCache(max_entries=8, num_shards=1)
    gen = cache.generation  # the caller reads the generation, then computes ...
    cache.invalidate()  # ... and the policy changes meanwhile
    cache.put("k", "old-plan", generation=gen)
    assert cache.get("k") is None
    cache.put("k", "new-plan", generation=cache.generation)
    assert cache.get("k") == "new-plan"


@pytest.mark.parametrize("generation", [1, -1, 0.0, "0", True])
def test_put_bad_generation_raises(generation):
    cache = SelectionCache(max_entries=8, num_shards=1)
    with pytest.raises(InvalidInputError, match=r"put generation: expected an int in \[0, 0\]"):
        cache.put("k", "v", generation=generation)


def test_none_value_and_unhashable_key_raise():
    cache = SelectionCache(max_entries=8, num_shards=1)
    with pytest.raises(InvalidInputError, match="put value: expected not None, got None"):
        cache.put("k", None)
    for call in (lambda: cache.get(["list"]), lambda: cache.put(["list"], 1)):
        with pytest.raises(InvalidInputError, match="key: expected a hashable tuple, got list"):
            call()
    with pytest.raises(InvalidInputError, match="key: expected a hashable tuple, got dict"):
        cache.get_or_compute({"a": 1}, lambda: 1)


def test_errors_are_builtin_subclasses_too():
    assert issubclass(InvalidInputError, ValueError) and issubclass(SelectionTimeoutError, TimeoutError)
    assert issubclass(SelectionTimeoutError, LayerZeroError)


def test_clear_removes_everything_and_bumps_versions():
    cache = SelectionCache(max_entries=8, num_shards=2)
    cache.put(0, "a")
    cache.put(1, "b")
    before = cache.shard_versions()
    cache.clear()
    assert cache.get(0) is None and cache.get(1) is None and len(cache) == 0
    assert all(after > b for after, b in zip(cache.shard_versions(), before, strict=True))
    assert cache.generation == 0  # clear is not an invalidation


def test_shard_version_bumps_only_for_the_written_shard():
    cache = SelectionCache(max_entries=16, num_shards=4)
    assert cache.shard_versions() == (0, 0, 0, 0)
    cache.put(6, "x")  # 6 & 3 == 2
    assert cache.shard_versions() == (0, 0, 1, 0)
    cache.put(6, "y")  # a replacement is a write too
    cache.put(9, "z")  # 9 & 3 == 1
    assert cache.shard_versions() == (0, 1, 2, 0)
    cache.get(6)  # reads never write
    assert cache.shard_versions() == (0, 1, 2, 0)


def test_stale_entry_is_dropped_on_read_miss():
    cache = SelectionCache(max_entries=4, num_shards=1)
    cache.put("k", "v")
    cache.invalidate()
    assert cache.shard_versions() == (1,)
    assert cache.get("k") is None
    assert cache.shard_versions() == (2,)  # the stale entry was removed (a write)
    assert cache.get("k") is None
    assert cache.shard_versions() == (2,)  # nothing left to remove


# ---------------------------------------------------------------- TTL


def test_ttl_expiry_with_fake_clock():
    clock = FakeClock()
    cache = SelectionCache(max_entries=8, num_shards=1, ttl_s=10, clock=clock)
    clock.now = 100.0
    cache.put("k", "v")  # expires at 110.0
    clock.now = 109.999
    assert cache.get("k") == "v"  # a hit does not refresh the TTL
    clock.now = 110.0
    assert cache.get("k") is None
    assert cache.stats().size == 0


def test_no_clock_call_on_hit_when_ttl_is_off():
    clock = FakeClock()
    cache = SelectionCache(max_entries=8, num_shards=1, clock=clock)
    cache.put("k", "v")
    for _ in range(5):
        assert cache.get("k") == "v"
    assert cache.get_or_compute("k", lambda: "other") == "v"
    assert clock.calls == 0


# ---------------------------------------------------------------- LRU


def test_lru_eviction_order_by_hand():
    cache = SelectionCache(max_entries=3, num_shards=1)
    cache.put("a", 1)
    cache.put("b", 2)
    cache.put("c", 3)  # recency (old -> new): a b c
    assert cache.get("a") == 1  # b c a
    cache.put("d", 4)  # full: evicts b -> c a d
    assert cache.get("b") is None
    cache.put("c", 30)  # replacing an entry never evicts: a d c
    cache.put("e", 5)  # evicts a -> d c e
    assert [cache.get(k) for k in "abcde"] == [None, None, 30, 4, 5]
    assert cache.stats().evictions == 2
    assert len(cache) == 3


def test_full_shard_drops_stale_before_evicting_live():
    cache = SelectionCache(max_entries=2, num_shards=1)
    cache.put("a", 1)
    cache.invalidate()
    cache.put("b", 2)  # shard: a (stale), b
    cache.put("c", 3)  # full: a is dropped, b survives
    assert (cache.get("b"), cache.get("c")) == (2, 3)
    assert cache.stats().evictions == 0


def test_full_shard_drops_expired_before_evicting_live():
    clock = FakeClock()
    cache = SelectionCache(max_entries=2, num_shards=1, ttl_s=5.0, clock=clock)
    cache.put("a", 1)  # expires at 5
    clock.now = 3.0
    cache.put("b", 2)  # expires at 8
    cache.get("a")  # a is now more recently used than b, but it will expire first
    clock.now = 6.0
    cache.put("c", 3)
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == (None, 2, 3)
    assert cache.stats().evictions == 0


# ---------------------------------------------------------------- get_or_compute


def test_get_or_compute_computes_once_then_hits():
    cache = SelectionCache(max_entries=8, num_shards=1)
    calls = []

    def compute():
        calls.append(1)
        return f"plan-{len(calls)}"

    assert cache.get_or_compute(KEY, compute) == "plan-1"
    assert cache.get_or_compute(KEY, compute) == "plan-1"
    assert cache.get(KEY) == "plan-1"
    assert len(calls) == 1
    cache.invalidate()
    assert cache.get_or_compute(KEY, compute) == "plan-2"
    assert len(calls) == 2


@pytest.mark.parametrize("timeout_s", [0, -1.0, float("nan"), float("inf"), "5", True])
def test_get_or_compute_bad_timeout_raises(timeout_s):
    cache = SelectionCache(max_entries=8, num_shards=1)
    with pytest.raises(InvalidInputError, match="timeout_s: expected None or a number in"):
        cache.get_or_compute(KEY, lambda: 1, timeout_s=timeout_s)


def test_get_or_compute_rejects_non_callable_and_none_result():
    cache = SelectionCache(max_entries=8, num_shards=1)
    with pytest.raises(InvalidInputError, match="compute: expected a callable, got 'plan'"):
        cache.get_or_compute(KEY, "plan")
    with pytest.raises(InvalidInputError, match=r"compute\(\): expected a value, not None, got None"):
        cache.get_or_compute(KEY, lambda: None)
    assert cache.get_or_compute(KEY, lambda: "ok") == "ok"  # nothing was left in flight or cached


def test_invalidation_during_compute_returns_value_but_does_not_store_it():
    cache = SelectionCache(max_entries=8, num_shards=1)

    def compute():
        cache.invalidate()  # the policy changes while this plan is being selected
        return "plan-from-gen-0"

    assert cache.get_or_compute(KEY, compute) == "plan-from-gen-0"
    assert cache.get(KEY) is None
    assert cache.get_or_compute(KEY, lambda: "plan-from-gen-1") == "plan-from-gen-1"


def test_recursive_lookup_of_own_key_raises_instead_of_deadlocking():
    cache = SelectionCache(max_entries=8, num_shards=1)

    def compute():
        return cache.get_or_compute(KEY, lambda: "inner", timeout_s=None)

    with pytest.raises(SelectionTimeoutError, match="from its own compute"):
        cache.get_or_compute(KEY, compute)
    assert cache.get_or_compute(KEY, lambda: "fine") == "fine"


def _run_threads(n, target):
    """Run ``target(i)`` in ``n`` threads; return (results, errors) indexed by thread."""
    results: list[object] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def run(i):
        try:
            results[i] = target(i)
        except BaseException as exc:  # noqa: BLE001 - collected and checked by the test
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return results, errors


def test_single_flight_eight_threads_compute_once():
    cache = SelectionCache(max_entries=8, num_shards=1)
    barrier = threading.Barrier(8)
    calls = []

    def compute():
        calls.append(threading.get_ident())
        _wait_until(lambda: cache.stats().misses >= 8, timeout_s=2.0)  # let all 8 threads miss first
        time.sleep(0.05)
        return object()

    def worker(_i):
        barrier.wait()
        return cache.get_or_compute(KEY, compute)

    results, errors = _run_threads(8, worker)
    assert errors == [None] * 8
    assert len(calls) == 1
    assert all(r is results[0] for r in results)  # the same object, not equal copies
    assert cache.get(KEY) is results[0]
    assert cache.stats().misses >= 2  # at least one thread really waited on the in-flight compute


def test_exception_in_compute_reaches_every_waiter_and_is_not_cached():
    cache = SelectionCache(max_entries=8, num_shards=1)
    barrier = threading.Barrier(8)
    calls = []

    def failing():
        calls.append(1)
        _wait_until(lambda: cache.stats().misses >= 8, timeout_s=2.0)
        time.sleep(0.05)
        raise RuntimeError("selection exploded")

    def worker(_i):
        barrier.wait()
        return cache.get_or_compute(KEY, failing)

    _, errors = _run_threads(8, worker)
    assert len(calls) == 1
    assert all(isinstance(e, RuntimeError) and str(e) == "selection exploded" for e in errors)
    assert all(e is errors[0] for e in errors)
    assert cache.get(KEY) is None
    assert cache.get_or_compute(KEY, lambda: "recovered") == "recovered"


def test_waiter_times_out_with_selection_timeout_error():
    cache = SelectionCache(max_entries=8, num_shards=1)
    release = threading.Event()
    started = threading.Event()

    def slow():
        started.set()
        release.wait(10)
        return "slow-plan"

    leader = threading.Thread(target=lambda: cache.get_or_compute(KEY, slow))
    leader.start()
    try:
        assert started.wait(5)
        t0 = time.monotonic()
        with pytest.raises(SelectionTimeoutError, match=r"expected a result within 0\.05 s"):
            cache.get_or_compute(KEY, lambda: "never", timeout_s=0.05)
        assert 0.04 <= time.monotonic() - t0 < 2.0
    finally:
        release.set()
        leader.join(10)
    assert cache.get(KEY) == "slow-plan"


def test_callers_after_invalidation_do_not_join_the_old_flight():
    cache = SelectionCache(max_entries=8, num_shards=1)
    release = threading.Event()
    started = threading.Event()
    old: list[object] = []

    def old_compute():
        started.set()
        release.wait(10)
        return "plan-gen-0"

    leader = threading.Thread(target=lambda: old.append(cache.get_or_compute(KEY, old_compute)))
    leader.start()
    try:
        assert started.wait(5)
        cache.invalidate()
        # Joining the gen-0 flight would time out (it is blocked); a fresh flight computes now.
        assert cache.get_or_compute(KEY, lambda: "plan-gen-1", timeout_s=0.5) == "plan-gen-1"
    finally:
        release.set()
        leader.join(10)
    assert old == ["plan-gen-0"]  # returned to its own caller ...
    assert cache.get(KEY) == "plan-gen-1"  # ... but never stored over the fresh plan


def test_cache_stats_is_frozen():
    stats = SelectionCache(max_entries=8, num_shards=1).stats()
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.hits = 5  # type: ignore[misc]
