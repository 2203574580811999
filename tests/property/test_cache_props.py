"""Property tests of SelectionCache against simple dict / OrderedDict models (hypothesis).

* Unbounded model (``max_entries`` large, any shard count): the observable hits, misses, stored values,
  compute calls and sizes equal those of a plain dict that ``invalidate`` empties.
* Exact LRU+TTL model (``num_shards=1``): an ``OrderedDict`` LRU list with expiry times reproduces the
  cache's hits and eviction count exactly.
* Bounds (any shard count, tiny ``max_entries``): stored entries never exceed ``max_entries`` nor a
  shard's ``ceil(max_entries / num_shards)``, and a just-written key is always readable.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layerzero.core.cache import SelectionCache

pytestmark = pytest.mark.property

KEYS = st.one_of(st.integers(-3, 12), st.tuples(st.sampled_from(["attn", "rms"]), st.integers(0, 3)))
OPS = st.one_of(
    st.tuples(st.just("put"), KEYS, st.integers(0, 10**6)),
    st.tuples(st.just("get"), KEYS),
    st.tuples(st.just("goc"), KEYS, st.integers(0, 10**6)),
    st.tuples(st.just("invalidate")),
    st.tuples(st.just("clear")),
)


class FakeClock:
    """Manual clock, seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(OPS, max_size=60), num_shards=st.sampled_from([1, 2, 16, 256]))
def test_unbounded_cache_matches_dict_model(ops, num_shards):
    cache: SelectionCache[int] = SelectionCache(max_entries=1024, num_shards=num_shards)
    model: dict[object, int] = {}
    hits = misses = 0
    for op in ops:
        if op[0] == "put":
            _, key, value = op
            cache.put(key, value)
            model[key] = value
        elif op[0] == "get":
            got = cache.get(op[1])
            assert got == model.get(op[1])
            hits, misses = (hits + 1, misses) if op[1] in model else (hits, misses + 1)
        elif op[0] == "goc":
            _, key, value = op
            calls: list[int] = []
            got = cache.get_or_compute(key, lambda v=value, c=calls: c.append(v) or v)
            expected_calls = 0 if key in model else 1
            hits, misses = (hits + 1, misses) if key in model else (hits, misses + 1)
            model.setdefault(key, value)
            assert got == model[key]
            assert len(calls) == expected_calls
        elif op[0] == "invalidate":
            cache.invalidate()
            model.clear()
        else:
            cache.clear()
            model.clear()
        assert len(cache) == len(model)
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.size) == (hits, misses, len(model))
    assert stats.invalidations == sum(op[0] == "invalidate" for op in ops)


LRU_OPS = st.one_of(
    st.tuples(st.just("put"), st.integers(0, 7), st.integers(0, 99)),
    st.tuples(st.just("get"), st.integers(0, 7)),
    st.tuples(st.just("invalidate")),
    st.tuples(st.just("advance"), st.sampled_from([0.5, 1.0, 2.5, 4.0])),
)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(LRU_OPS, max_size=80), cap=st.integers(1, 6), ttl=st.sampled_from([None, 3.0]))
def test_single_shard_matches_exact_lru_ttl_model(ops, cap, ttl):
    clock = FakeClock()
    cache: SelectionCache[int] = SelectionCache(max_entries=cap, num_shards=1, ttl_s=ttl, clock=clock)
    lru: OrderedDict[int, tuple[int, float]] = OrderedDict()  # key -> (value, expires_at); oldest first
    evictions = 0

    def alive(key: int) -> bool:
        return key in lru and clock.now < lru[key][1]

    for op in ops:
        if op[0] == "put":
            _, key, value = op
            if key not in lru and len(lru) >= cap:
                for dead in [k for k in lru if not alive(k)]:
                    del lru[dead]
                if len(lru) >= cap:
                    lru.popitem(last=False)
                    evictions += 1
            lru[key] = (value, math.inf if ttl is None else clock.now + ttl)
            lru.move_to_end(key)
            cache.put(key, value)
        elif op[0] == "get":
            key = op[1]
            if alive(key):
                lru.move_to_end(key)
                assert cache.get(key) == lru[key][0]
            else:
                assert cache.get(key) is None
        elif op[0] == "invalidate":
            cache.invalidate()
            lru.clear()
        else:
            clock.now += op[1]
        assert len(cache) == sum(alive(k) for k in lru) <= cap
    assert cache.stats().evictions == evictions


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    max_entries=st.integers(1, 40),
    ops=st.lists(st.one_of(st.integers(-50, 200), st.just("invalidate")), max_size=120),
)
def test_tiny_bound_is_never_exceeded(data, max_entries, ops):
    num_shards = data.draw(st.sampled_from([1 << i for i in range(max_entries.bit_length())]))
    cache: SelectionCache[int] = SelectionCache(max_entries=max_entries, num_shards=num_shards)
    per_shard_cap = math.ceil(max_entries / num_shards)
    for op in ops:
        if op == "invalidate":
            cache.invalidate()
            continue
        cache.put(op, op + 1)
        assert cache.get(op) == op + 1  # a write never evicts itself
        # White-box: count every stored entry, stale ones included (len() counts live ones only).
        stored = [len(shard.entries) for shard in cache._shards]
        assert sum(stored) <= max_entries
        assert max(stored) <= per_shard_cap
        assert len(cache) <= max_entries
