"""Unit tests of layerzero.engine.core.kv.RadixCache: tree shape, matching, leaf-first eviction, worked by
hand.

The manager releases blocks tail first, so its LRU head is always a leaf; these tests drive the cache
directly to release parents before children and show that eviction still takes leaves first.
"""

from __future__ import annotations

import pytest

from layerzero import InvalidInputError
from layerzero.engine.core.kv import KVCacheManager, RadixCache

pytestmark = pytest.mark.unit


def children(cache: RadixCache, *path: int) -> list[int]:
    """Block ids of the children of the node reached by the block ids ``path`` (root when empty)."""
    node = cache._root
    for block in path:
        node = next(c for c in node.children.values() if c.block == block)
    return sorted(c.block for c in node.children.values())


def test_tree_shape_and_match() -> None:
    cache = RadixCache(block_size=2)
    assert cache.insert([1, 2, 3, 4, 5, 6], [0, 1, 2]) == 3
    assert cache.insert([1, 2, 3, 4, 7, 8, 9], [0, 1, 3], start=2) == 3  # a branch under block 1
    assert cache.insert([5, 6], [4]) == 1  # another root child
    assert children(cache) == [0, 4]
    assert children(cache, 0) == [1]
    assert children(cache, 0, 1) == [2, 3]
    assert cache.match([1, 2, 3, 4, 7, 8, 0]) == [0, 1, 3]
    assert cache.match([1, 2, 3, 4, 7]) == [0, 1]  # a partial block never matches
    assert cache.match([5, 6, 1, 2]) == [4]
    assert cache.match([2, 1]) == []
    assert cache.num_cached_blocks() == 5
    cache.check_invariants()


def test_insert_stops_at_a_block_held_by_another_id() -> None:
    cache = RadixCache(block_size=2)
    cache.insert([1, 2, 3, 4], [0, 1])
    assert cache.insert([1, 2, 3, 4, 5, 6], [7, 8, 9]) == 0  # block 0's chunk is held by 0
    assert cache.insert([1, 2, 3, 4, 5, 6], [0, 1, 9]) == 3  # idempotent, then extends
    assert not cache.is_cached(7) and cache.is_cached(9)
    with pytest.raises(InvalidInputError, match="to be in the tree"):
        cache.insert([1, 2, 3, 4], [5, 6], start=1)
    with pytest.raises(InvalidInputError, match="already in the tree"):
        cache.insert([8, 8], [9])
    cache.check_invariants()


def test_eviction_is_leaf_first_even_when_parents_were_released_first() -> None:
    cache = RadixCache(block_size=1)
    cache.insert([1, 2, 3], [0, 1, 2])  # 0 -> 1 -> 2
    cache.insert([1, 5], [0, 3], start=1)  # 0 -> 3
    for block in (0, 1, 3, 2):  # parents released before children
        cache.release(block)
    cache.check_invariants()
    assert cache.evictable_blocks() == [0, 1, 3, 2]
    assert cache.evict() == 3  # 0 and 1 have children: the least recent leaf is 3
    assert cache.evict() == 2
    assert cache.evict() == 1  # 1 became a leaf when 2 went
    assert cache.evict() == 0
    assert cache.evict() is None
    assert cache.num_cached_blocks() == 0 and cache.match([1, 2, 3]) == []
    cache.check_invariants()


def test_evicting_a_branch_keeps_its_siblings() -> None:
    cache = RadixCache(block_size=1)
    cache.insert([1, 2], [0, 1])
    cache.insert([1, 3], [0, 2], start=1)
    for block in (1, 2, 0):
        cache.release(block)
    cache.acquire(0)  # referenced again
    assert cache.evict() == 1
    assert cache.match([1, 3]) == [0, 2] and cache.match([1, 2]) == [0]
    assert cache.evict() == 2
    assert cache.evict() is None  # 0 is referenced
    cache.check_invariants()


def test_check_invariants_catches_a_referenced_child_under_an_evictable_parent() -> None:
    cache = RadixCache(block_size=1)
    cache.insert([1, 2], [0, 1])
    cache.release(0)
    with pytest.raises(AssertionError, match="evictable block 0 has a referenced child"):
        cache.check_invariants()


def test_manager_radix_evicts_leaves_of_shared_prefix_last() -> None:
    kv = KVCacheManager(6, 2, prefix_cache="radix", watermark=0)
    system = [7, 7, 8, 8]
    for req, tail in (("a", [1, 1]), ("b", [2, 2])):
        prompt = system + tail + [0]
        blocks, _ = kv.get_computed_blocks(prompt)
        kv.allocate_slots(req, len(prompt), blocks)
        kv.cache_blocks(req, prompt, len(prompt))
    assert kv.block_table("a") == [0, 1, 2, 3] and kv.block_table("b") == [0, 1, 4, 5]
    kv.free("a")  # 3 free (partial), 2 evictable; 0, 1 still used by b
    kv.free("b")  # 5 free, then 4, 1, 0 evictable
    assert children(kv._cache, 0, 1) == [2, 4]
    assert kv.allocate_slots("c", 6) == [3, 5, 2]  # free list first, then the least recent leaf
    assert kv.get_computed_blocks(system + [2, 2, 0]) == ([0, 1, 4], 6)
    kv.check_invariants()
