"""Tests of layerzero.engine.core.kv.prefix_cache (HashPrefixCache, block_hash) and a randomized test of
KVCacheManager with both prefix-cache kinds against a brute-force oracle.

The oracle knows nothing of hashes or trees: it remembers, per block id, the token prefix the block was
registered for (the request's tokens up to and including that block), forgets it when the manager hands the
block out again (the block was evicted), and answers a lookup with the longest full-block prefix whose every
block-boundary prefix is registered, capped at ``len(tokens) - 1`` tokens.
"""

from __future__ import annotations

import hashlib
import random
from array import array

import pytest

from layerzero import InvalidInputError
from layerzero.engine.core.kv import (
    ROOT_HASH,
    HashPrefixCache,
    KVCacheManager,
    OutOfBlocksError,
    block_hash,
)

pytestmark = pytest.mark.unit


def test_block_hash_is_chained_sha256() -> None:
    h1 = block_hash(ROOT_HASH, [1, 2])
    assert h1 == hashlib.sha256(ROOT_HASH + array("q", [1, 2]).tobytes()).digest()
    assert block_hash(h1, [3, 4]) != block_hash(ROOT_HASH, [3, 4])  # same tokens, other prefix
    assert block_hash(ROOT_HASH, [1, 2]) == h1  # deterministic
    with pytest.raises(InvalidInputError, match="int64 range"):
        block_hash(ROOT_HASH, [2**63])
    with pytest.raises(InvalidInputError, match="int64 range"):
        block_hash(ROOT_HASH, ["a"])  # type: ignore[list-item]


def test_hash_cache_match_insert() -> None:
    cache = HashPrefixCache(block_size=2)
    assert cache.match([1, 2, 3]) == []
    assert cache.insert([1, 2, 3, 4, 5], [10, 11, 12]) == 2  # the partial block is not registered
    assert cache.match([1, 2, 3, 4, 5, 6]) == [10, 11]
    assert cache.match([1, 2, 3, 9]) == [10]
    assert cache.match([3, 4]) == []  # block 1's tokens alone are another prefix
    assert cache.insert([1, 2, 3, 4], [10, 11]) == 2  # idempotent
    assert (
        cache.insert([1, 2, 3, 4, 7, 8], [10, 11, 13], start=2) == 3
    )  # incremental, from a registered block
    assert cache.insert([1, 2, 5, 6], [20, 21]) == 0  # block 0's prefix is held by 10: nothing registered
    assert cache.insert([1, 2, 5, 6], [10, 21], start=1) == 2  # a branch after a shared block
    assert cache.num_cached_blocks() == 4 and all(cache.is_cached(b) for b in (10, 11, 13, 21))
    with pytest.raises(InvalidInputError, match="to be registered before"):
        cache.insert([1, 2, 3, 4], [30, 31], start=1)
    with pytest.raises(InvalidInputError, match="already registered for another prefix"):
        cache.insert([9, 9], [10])
    cache.check_invariants()


def test_hash_cache_lru() -> None:
    cache = HashPrefixCache(block_size=1)
    cache.insert([1, 2, 3], [0, 1, 2])
    for block in (2, 1, 0):
        cache.release(block)
    cache.acquire(1)
    assert cache.evictable_blocks() == [2, 0] and cache.num_evictable() == 2
    assert cache.evict() == 2
    assert cache.match([1, 2, 3]) == [0, 1]
    assert cache.evict() == 0
    assert cache.evict() is None
    assert cache.match([1, 2, 3]) == [] and cache.num_cached_blocks() == 1
    cache.check_invariants()


class Oracle:
    """Brute-force model of the manager's observable behaviour (block tables, lookups, allocation)."""

    def __init__(self, num_blocks: int, block_size: int, watermark_blocks: int) -> None:
        self.n, self.bs, self.wm = num_blocks, block_size, watermark_blocks
        self.tables: dict[int, list[int]] = {}
        self.content: dict[int, tuple[int, ...]] = {}  # block -> registered prefix, while resident
        self.cached: dict[int, int] = {}
        self.stopped: set[int] = set()

    def refs(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for table in self.tables.values():
            for b in table:
                out[b] = out.get(b, 0) + 1
        return out

    def owner(self, prefix: tuple[int, ...]) -> int | None:
        return next((b for b, p in self.content.items() if p == prefix), None)

    def lookup(self, tokens: list[int]) -> list[int]:
        out = []
        for k in range(1, max(len(tokens) - 1, 0) // self.bs + 1):
            b = self.owner(tuple(tokens[: k * self.bs]))
            if b is None:
                break
            out.append(b)
        return out

    def fits(self, req: int, num_tokens: int, computed: list[int], admit: bool) -> bool:
        refs = self.refs()
        current = len(self.tables.get(req, computed))
        need = max(-(-num_tokens // self.bs) - current, 0)
        available = self.n - len(refs) - sum(1 for b in computed if b not in refs)
        return need <= available - (self.wm if admit else 0)

    def allocated(self, req: int, computed: list[int], new: list[int]) -> None:
        refs = self.refs()
        assert not any(b in refs or b in computed for b in new), "handed out a referenced block"
        for b in new:
            self.content.pop(b, None)
        if req not in self.tables:
            self.tables[req], self.cached[req] = list(computed), len(computed)
        self.tables[req].extend(new)

    def cache(self, req: int, tokens: list[int], num_computed: int) -> None:
        table = self.tables[req]
        num_full = min(min(num_computed, len(tokens)) // self.bs, len(table))
        while req not in self.stopped and self.cached[req] < num_full:
            i = self.cached[req]
            prefix = tuple(tokens[: (i + 1) * self.bs])
            owner = self.owner(prefix)
            if owner is None:
                self.content[table[i]] = prefix
            elif owner != table[i]:
                self.stopped.add(req)
                break
            self.cached[req] = i + 1

    def fork(self, parent: int, child: int, num_tokens: int, copies: list[tuple[int, int]]) -> None:
        full, partial = divmod(num_tokens, self.bs)
        self.allocated(child, self.tables[parent][:full], [dst for _, dst in copies])
        assert copies == ([(self.tables[parent][full], self.tables[child][-1])] if partial else [])
        self.cached[child] = min(self.cached[parent], full)
        if parent in self.stopped and self.cached[parent] < full:
            self.stopped.add(child)

    def free(self, req: int) -> None:
        del self.tables[req], self.cached[req]
        self.stopped.discard(req)

    def reset(self) -> None:
        refs = self.refs()
        self.content = {b: p for b, p in self.content.items() if b in refs}


def random_run(kind: str, seed: int, steps: int = 400) -> list:
    """Random requests sharing prefixes: lookup/allocate/cache (chunked)/decode/fork/free/reset, each step
    checked against the oracle and the manager's invariants. Returns the trace of every observable result."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 3, 4])
    num_blocks = rng.randint(12, 40)
    kv = KVCacheManager(num_blocks, bs, prefix_cache=kind, watermark=rng.choice([0.0, 0.1]))
    oracle = Oracle(num_blocks, bs, kv.watermark_blocks)
    docs = [[rng.randrange(3) for _ in range(rng.randint(2, 5) * bs)] for _ in range(3)]
    tokens: dict[int, list[int]] = {}
    computed: dict[int, int] = {}
    trace: list = []
    next_id = 0
    for _ in range(steps):
        op = rng.random()
        running = sorted(oracle.tables)
        if op < 0.35 or not running:  # a new request
            doc = rng.choice(docs)
            prompt = doc[: rng.randint(0, len(doc))] + [
                rng.randrange(3) for _ in range(rng.randint(1, 2 * bs + 1))
            ]
            blocks, hit = kv.get_computed_blocks(prompt)
            assert blocks == oracle.lookup(prompt) and hit == len(blocks) * bs
            admit = rng.random() < 0.5
            fits = oracle.fits(next_id, len(prompt), blocks, admit)
            new = kv.allocate_slots(next_id, len(prompt), blocks, admit=admit)
            trace.append(("new", hit, new))
            assert (new is not None) == fits
            if new is not None:
                oracle.allocated(next_id, blocks, new)
                tokens[next_id], computed[next_id] = prompt, rng.randint(hit, len(prompt))
                kv.cache_blocks(next_id, prompt, computed[next_id])
                oracle.cache(next_id, prompt, computed[next_id])
            next_id += 1
        elif op < 0.7:  # a step: more prefill, or decode new tokens
            req = rng.choice(running)
            if computed[req] < len(tokens[req]):
                computed[req] = rng.randint(computed[req] + 1, len(tokens[req]))
            else:
                extra = [rng.randrange(3) for _ in range(rng.randint(1, bs + 1))]
                fits = oracle.fits(req, len(tokens[req]) + len(extra), [], False)
                new = kv.allocate_slots(req, len(tokens[req]) + len(extra))
                trace.append(("grow", new))
                assert (new is not None) == fits
                if new is None:
                    continue
                oracle.allocated(req, [], new)
                tokens[req] = tokens[req] + extra
                computed[req] = len(tokens[req]) - rng.randint(0, 1)
            kv.cache_blocks(req, tokens[req], computed[req])
            oracle.cache(req, tokens[req], computed[req])
        elif op < 0.8:  # fork (parallel sampling / beam)
            parent = rng.choice(running)
            n = rng.randint(0, len(tokens[parent]))
            try:
                copies = kv.fork(parent, next_id, n)
            except OutOfBlocksError:
                assert n % bs and kv.num_free_blocks() == 0 == oracle.n - len(oracle.refs())
                trace.append(("fork", None))
            else:
                trace.append(("fork", copies))
                oracle.fork(parent, next_id, n, copies)
                tokens[next_id], computed[next_id] = tokens[parent][:n], min(computed[parent], n)
            next_id += 1
        elif op < 0.98:
            req = rng.choice(running)
            kv.free(req)
            oracle.free(req)
        else:
            trace.append(("reset", kv.reset_prefix_cache()))
            oracle.reset()
        kv.check_invariants()
        assert {r: kv.block_table(r) for r in oracle.tables} == oracle.tables
        assert kv.stats().num_cached_blocks == len(oracle.content)
        assert kv.num_free_blocks() == num_blocks - len(oracle.refs())
        assert kv.usage() == pytest.approx(len(oracle.refs()) / num_blocks)
    trace.append(kv.stats())
    return trace


@pytest.mark.parametrize("seed", range(12))
def test_random_requests_hash_and_radix_agree_with_oracle(seed: int) -> None:
    hash_trace = random_run("hash", seed)
    radix_trace = random_run("radix", seed)
    assert hash_trace == radix_trace  # same hits, same blocks handed out, same evictions
    stats = hash_trace[-1]
    assert stats.hits > 0 and stats.queries > stats.hits
