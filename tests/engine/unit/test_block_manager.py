"""Unit tests of layerzero.engine.core.kv.KVCacheManager: cases worked out by hand, both prefix-cache kinds.

Block ids are predictable: the free list hands out 0, 1, 2, ... in order, freed blocks go to its back, and
``free`` releases a table tail first (so the tail of a cached request is evicted first).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from layerzero import ConfigurationError, InvalidInputError, LayerZeroError
from layerzero.engine.core.kv import KVCacheManager, OutOfBlocksError, PrefixCacheStats

pytestmark = pytest.mark.unit

KINDS = ["hash", "radix"]


def snapshot(kv: KVCacheManager) -> tuple:
    """Everything observable about a manager (to show that a failed call changed nothing)."""
    tables = {r: kv.block_table(r) for r in list(kv._tables)}
    return (
        tables,
        kv.num_free_blocks(),
        kv.usage(),
        kv.stats(),
        kv.pool.free_blocks(),
        kv._cache.evictable_blocks(),
    )


def run_prompt(kv: KVCacheManager, req: str, tokens: list[int]) -> list[int]:
    """Look up, allocate and fully compute ``tokens`` for ``req``; return its block table."""
    blocks, _ = kv.get_computed_blocks(tokens)
    assert kv.allocate_slots(req, len(tokens), blocks) is not None
    kv.cache_blocks(req, tokens, len(tokens))
    kv.check_invariants()
    return kv.block_table(req)


@pytest.mark.parametrize("kind", KINDS)
def test_shared_two_blocks_hit_exactly_two_blocks(kind: str) -> None:
    kv = KVCacheManager(16, 4, prefix_cache=kind)
    a = list(range(12))  # exactly 3 full blocks
    assert run_prompt(kv, "a", a) == [0, 1, 2]
    b = a[:8] + [100, 101, 102, 103, 104]
    blocks, n = kv.get_computed_blocks(b)
    assert (blocks, n) == ([0, 1], 8)
    assert kv.allocate_slots("b", len(b), blocks) == [3, 4]  # 13 tokens = 4 blocks, 2 computed
    assert kv.block_table("b") == [0, 1, 3, 4]
    kv.check_invariants()
    assert kv.stats() == PrefixCacheStats(queries=12 + 13, hits=8, evictions=0, num_cached_blocks=3)
    assert kv.stats().hit_rate == pytest.approx(8 / 25)
    assert kv.usage() == pytest.approx(5 / 16)


@pytest.mark.parametrize("kind", KINDS)
def test_never_the_whole_prompt(kind: str) -> None:
    kv = KVCacheManager(16, 4, prefix_cache=kind)
    a = list(range(12))
    run_prompt(kv, "a", a)
    assert kv.get_computed_blocks(a) == ([0, 1], 8)  # 11 tokens at most -> 2 blocks
    assert kv.get_computed_blocks(a + [99]) == ([0, 1, 2], 12)
    assert kv.get_computed_blocks(a[:9]) == ([0, 1], 8)
    assert kv.get_computed_blocks(a[:8]) == ([0], 4)
    assert kv.get_computed_blocks(a[:1]) == ([], 0)
    assert kv.get_computed_blocks([]) == ([], 0)
    assert kv.get_computed_blocks([5] + a) == ([], 0)  # same blocks at another offset: no hit


@pytest.mark.parametrize("kind", KINDS)
def test_record_false_leaves_stats(kind: str) -> None:
    kv = KVCacheManager(8, 2, prefix_cache=kind)
    run_prompt(kv, "a", [1, 2, 3, 4, 5])
    before = kv.stats()
    assert kv.get_computed_blocks([1, 2, 3, 4, 5], record=False) == ([0, 1], 4)
    assert kv.stats() == before


@pytest.mark.parametrize("kind", KINDS)
def test_freed_request_blocks_are_reused_by_same_prefix(kind: str) -> None:
    kv = KVCacheManager(8, 4, prefix_cache=kind)
    prompt = list(range(10))
    assert run_prompt(kv, "a", prompt) == [0, 1, 2]
    kv.free("a")
    kv.check_invariants()
    assert kv.num_free_blocks() == 8 and kv.usage() == 0
    assert kv.stats().num_cached_blocks == 2  # the partial third block was never cached
    blocks, n = kv.get_computed_blocks(prompt)
    assert (blocks, n) == ([0, 1], 8)
    # free list now: 3..7 then 2 (freed); the evictable cached blocks 0, 1 are taken back out of the LRU
    assert kv.allocate_slots("b", len(prompt), blocks) == [3]
    assert kv.block_table("b") == [0, 1, 3]
    assert kv.num_free_blocks() == 5
    kv.check_invariants()


@pytest.mark.parametrize("kind", KINDS)
def test_eviction_is_lru_tail_first(kind: str) -> None:
    kv = KVCacheManager(4, 2, prefix_cache=kind, watermark=0)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    assert run_prompt(kv, "a", a) == [0, 1]
    assert run_prompt(kv, "b", b) == [2, 3]
    kv.free("a")  # LRU: 1, 0
    kv.free("b")  # LRU: 1, 0, 3, 2
    assert kv._cache.evictable_blocks() == [1, 0, 3, 2]
    assert kv.allocate_slots("c", 1) == [1]  # a's tail goes first
    assert kv.get_computed_blocks(a + [0]) == ([0], 2)  # a's first block is still cached
    assert kv.allocate_slots("d", 4) == [0, 3]
    assert kv.get_computed_blocks(a + [0]) == ([], 0)
    assert kv.get_computed_blocks(b + [0]) == ([2], 2)  # b's tail went, its head stays
    assert kv.stats().evictions == 3
    kv.check_invariants()


@pytest.mark.parametrize("kind", KINDS)
def test_hit_refreshes_lru_position(kind: str) -> None:
    kv = KVCacheManager(4, 2, prefix_cache=kind, watermark=0)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    run_prompt(kv, "a", a)
    run_prompt(kv, "b", b)
    kv.free("a")
    kv.free("b")  # LRU: 1, 0, 3, 2
    blocks, _ = kv.get_computed_blocks(a + [9])
    assert kv.allocate_slots("a2", 4, blocks) == []  # a's blocks referenced again, leave the LRU
    assert kv._cache.evictable_blocks() == [3, 2]
    kv.free("a2")  # back at the most-recent end, tail first
    assert kv._cache.evictable_blocks() == [3, 2, 1, 0]
    assert kv.allocate_slots("c", 2) == [3]
    kv.check_invariants()


@pytest.mark.parametrize("kind", KINDS)
def test_allocation_failure_changes_nothing(kind: str) -> None:
    kv = KVCacheManager(6, 2, prefix_cache=kind, watermark=0)
    a = [1, 2, 3, 4, 5]
    run_prompt(kv, "a", a)  # 3 blocks: 0, 1, 2
    kv.free("a")  # 0, 1 evictable, 2 free
    run_prompt(kv, "x", [9, 9])  # takes block 3 from the free list
    blocks, _ = kv.get_computed_blocks(a + [6, 7, 8, 9, 10])
    assert blocks == [0, 1]
    before = snapshot(kv)
    # free: 4, 5, 2; evictable: 1, 0. The computed blocks stop being evictable, so 3 blocks are left for
    # new ones: 12 tokens (6 blocks, 4 new) fail and leave the computed blocks evictable; 10 tokens fit
    assert kv.allocate_slots("b", 12, blocks) is None
    assert snapshot(kv) == before
    assert kv.allocate_slots("b", 10, blocks) == [4, 5, 2]
    assert kv.allocate_slots("b", 11) is None  # existing table, no block left
    kv.check_invariants()


@pytest.mark.parametrize("kind", KINDS)
def test_admission_keeps_the_watermark(kind: str) -> None:
    kv = KVCacheManager(100, 1, prefix_cache=kind, watermark=0.1)
    assert kv.watermark_blocks == 10
    assert kv.can_allocate(91) and not kv.can_allocate(91, admit=True) and kv.can_allocate(90, admit=True)
    assert kv.allocate_slots("a", 91, admit=True) is None
    assert kv.allocate_slots("a", 90, admit=True) is not None
    assert kv.allocate_slots("b", 1, admit=True) is None
    assert kv.allocate_slots("a", 100) is not None  # running requests may use the reserve
    assert kv.num_free_blocks() == 0 and kv.usage() == 1.0
    kv.check_invariants()


@pytest.mark.parametrize("kind", KINDS)
def test_fork_shares_full_blocks_and_copies_partial(kind: str) -> None:
    kv = KVCacheManager(8, 4, prefix_cache=kind)
    tokens = list(range(10))
    assert run_prompt(kv, "p", tokens) == [0, 1, 2]
    assert kv.fork("p", "c", 10) == [(2, 3)]
    assert kv.block_table("c") == [0, 1, 3]
    assert kv.fork("p", "d", 8) == []  # on a block boundary: nothing to copy
    assert kv.block_table("d") == [0, 1]
    kv.check_invariants()
    assert kv.usage() == pytest.approx(4 / 8)
    for req in ("p", "c", "d"):
        kv.free(req)
        kv.check_invariants()
    assert kv.num_free_blocks() == 8 and kv.usage() == 0


@pytest.mark.parametrize("kind", KINDS)
def test_fork_out_of_blocks_changes_nothing(kind: str) -> None:
    kv = KVCacheManager(3, 4, prefix_cache=kind)
    kv.allocate_slots("p", 10)
    before = snapshot(kv)
    with pytest.raises(OutOfBlocksError, match="expected 1 free or evictable block"):
        kv.fork("p", "c", 10)
    assert snapshot(kv) == before and "c" not in kv
    assert issubclass(OutOfBlocksError, LayerZeroError) and issubclass(OutOfBlocksError, RuntimeError)
    assert kv.fork("p", "c", 8) == []  # full blocks only: no block needed


@pytest.mark.parametrize("kind", KINDS)
def test_child_caches_its_own_blocks(kind: str) -> None:
    kv = KVCacheManager(16, 2, prefix_cache=kind)
    tokens = [1, 2, 3, 4, 5]
    run_prompt(kv, "p", tokens)  # caches [0, 1]
    kv.fork("p", "c", 5)  # child gets block 3 for the copy of block 2
    child = tokens + [7, 8, 9]
    assert kv.allocate_slots("c", len(child)) == [4]
    kv.cache_blocks("c", child, len(child))
    kv.free("p")
    assert kv.get_computed_blocks(child + [10]) == ([0, 1, 3, 4], 8)
    kv.check_invariants()


@pytest.mark.parametrize("kind", KINDS)
def test_duplicate_block_stays_private(kind: str) -> None:
    kv = KVCacheManager(16, 2, prefix_cache=kind)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    kv.allocate_slots("a", 7)  # both admitted before either is computed: no hits
    kv.allocate_slots("b", 7)
    assert kv.block_table("a") == [0, 1, 2, 3] and kv.block_table("b") == [4, 5, 6, 7]
    kv.cache_blocks("a", tokens, 4)  # a caches its first 2 blocks
    kv.cache_blocks("b", tokens, 7)  # b's first block duplicates a's: b caches nothing
    assert kv.stats().num_cached_blocks == 2
    kv.cache_blocks("a", tokens, 7)
    assert kv.get_computed_blocks(tokens + [8]) == ([0, 1, 2], 6)
    kv.free("b")
    assert kv.num_free_blocks() == 12 and kv.stats().num_cached_blocks == 3  # b's blocks went free
    kv.check_invariants()


@pytest.mark.parametrize("kind", KINDS)
def test_reset_prefix_cache(kind: str) -> None:
    kv = KVCacheManager(8, 2, prefix_cache=kind)
    run_prompt(kv, "a", [1, 2, 3, 4, 5])
    run_prompt(kv, "b", [7, 8, 9])
    kv.free("a")
    assert kv.reset_prefix_cache() is False  # b's cached block is in use; a's were dropped
    assert kv.stats().num_cached_blocks == 1
    assert kv.get_computed_blocks([1, 2, 3, 4, 5]) == ([], 0)
    kv.check_invariants()
    kv.free("b")
    assert kv.reset_prefix_cache() is True
    assert kv.stats().num_cached_blocks == 0 and kv.num_free_blocks() == 8
    kv.check_invariants()


def test_disabled_prefix_caching() -> None:
    kv = KVCacheManager(4, 2, enable_prefix_caching=False)
    assert kv.allocate_slots("a", 4) == [0, 1]
    kv.cache_blocks("a", [1, 2, 3, 4], 4)
    kv.free("a")
    assert kv.get_computed_blocks([1, 2, 3, 4, 5]) == ([], 0)
    assert kv.stats() == PrefixCacheStats(0, 0, 0, 0) and kv.stats().hit_rate == 0.0
    assert kv.pool.free_blocks() == [2, 3, 1, 0]
    assert kv.reset_prefix_cache() is True
    with pytest.raises(InvalidInputError, match="computed_blocks"):
        kv.allocate_slots("b", 4, [0])
    kv.check_invariants()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_blocks": 0, "block_size": 4}, "num_blocks: expected an int >= 1, got 0"),
        ({"num_blocks": True, "block_size": 4}, "num_blocks"),
        ({"num_blocks": 4, "block_size": 0}, "block_size: expected an int >= 1, got 0"),
        ({"num_blocks": 4, "block_size": 2.0}, "block_size"),
        ({"num_blocks": 4, "block_size": 2, "prefix_cache": "lru"}, r"expected one of \['hash', 'radix'\]"),
        ({"num_blocks": 4, "block_size": 2, "watermark": 1.0}, r"watermark: expected a fraction in \[0, 1\)"),
        ({"num_blocks": 4, "block_size": 2, "watermark": -0.1}, "watermark"),
    ],
)
def test_bad_config(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        KVCacheManager(**kwargs)


def test_bad_calls() -> None:
    kv = KVCacheManager(8, 2)
    run_prompt(kv, "a", [1, 2, 3, 4, 5])
    with pytest.raises(InvalidInputError, match="num_tokens.*expected an int >= 0, got -1"):
        kv.allocate_slots("b", -1)
    with pytest.raises(InvalidInputError, match="expected none for a request that already has"):
        kv.allocate_slots("a", 8, [0])
    with pytest.raises(InvalidInputError, match="expected distinct cached blocks"):
        kv.allocate_slots("b", 8, [0, 0])
    with pytest.raises(InvalidInputError, match="expected distinct cached blocks"):
        kv.allocate_slots("b", 8, [5])  # not cached: a stale lookup
    with pytest.raises(InvalidInputError, match=r"num_tokens: expected an int >= 4, got 3"):
        kv.allocate_slots("b", 3, [0, 1])
    for call in (kv.free, kv.block_table, lambda r: kv.cache_blocks(r, [1], 1), lambda r: kv.fork(r, "z", 0)):
        with pytest.raises(InvalidInputError, match="unknown id"):
            call("nope")
    with pytest.raises(InvalidInputError, match=r"num_tokens: expected an int in \[0, 6\], got 7"):
        kv.fork("a", "c", 7)
    with pytest.raises(InvalidInputError, match="expected a new child id"):
        kv.fork("a", "a", 2)
    with pytest.raises(InvalidInputError, match="int64"):
        kv.get_computed_blocks([1, 2**70, 3])
    kv.check_invariants()


def test_block_tables_gathers_every_table_padded_with_zeros() -> None:
    """``block_tables`` (the engine's per-step gather from the numpy mirror) equals the tables, by hand,
    through growth, a free whose row is reused by a shorter table, a fork and more rows and columns than the
    mirror started with; an unknown id is refused. (``check_invariants`` compares the mirror with the tables
    after every step of the scheduler's property tests too.)"""
    kv = KVCacheManager(400, 2, enable_prefix_caching=False)
    assert kv.allocate_slots("a", 5) == [0, 1, 2] and kv.allocate_slots("b", 2) == [3]
    assert kv.block_tables(["b", "a"]).tolist() == [[3, 0, 0], [0, 1, 2]]
    assert kv.allocate_slots("a", 6) == [] and kv.allocate_slots("a", 7) == [4]
    kv.free("a")
    kv.allocate_slots("c", 1)  # takes a's row: only its own block, then zeros
    b_new = kv.allocate_slots("b", 6)
    assert kv.block_tables(["c", "b"]).tolist() == [[5, 0, 0], [3, *b_new]]
    assert kv.block_tables(["c"]).dtype.name == "int32"
    ((src, dst),) = kv.fork("b", "d", 3)
    assert src == b_new[0] and kv.block_tables(["d", "c"]).tolist() == [[3, dst], [5, 0]]
    for i in range(70):  # past the mirror's first 64 rows
        kv.allocate_slots(i, 2 * (i % 3 + 1))
    kv.allocate_slots("long", 2 * 100)  # past its first 64 columns
    kv.check_invariants()
    got = kv.block_tables([69, "long", 0])
    assert got.shape == (3, 100) and got[1].tolist() == kv.block_table("long")
    assert got[0, :1].tolist() == kv.block_table(69) and not got[0, 1:].any()
    with pytest.raises(InvalidInputError, match="block_tables.*unknown id"):
        kv.block_tables(["b", "nope"])


def test_allocate_slots_fast_path_keeps_validation() -> None:
    """A table that already holds the tokens returns [] without changes; bad arguments still raise with a
    table."""
    kv = KVCacheManager(8, 2)
    run_prompt(kv, "a", [1, 2, 3, 4, 5])
    before = snapshot(kv)
    assert kv.allocate_slots("a", 6) == [] and kv.allocate_slots("a", 0) == [] and snapshot(kv) == before
    with pytest.raises(InvalidInputError, match="expected an int >= 0, got -1"):
        kv.allocate_slots("a", -1)
    with pytest.raises(InvalidInputError, match="expected an int >= 0, got True"):
        kv.allocate_slots("a", True)


def test_kv_imports_only_public_layerzero() -> None:
    kv_dir = pathlib.Path(__file__).parents[3] / "src" / "layerzero" / "engine" / "kv"
    for path in kv_dir.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                name = ("." * node.level) + node.module
                assert not name.startswith("..") and "core" not in name and "torch" not in name, (path, name)
            elif isinstance(node, ast.Import):
                assert all("torch" not in a.name and "layerzero." not in a.name for a in node.names), path
