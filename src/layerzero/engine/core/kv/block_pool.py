"""The pool of KV-cache block ids: free list, refcounts, and the prefix cache's evictable blocks.

vLLM v1's ``BlockPool`` split out of the manager: every block is in exactly one state, *free* (in the deque
free list), *evictable* (registered in the prefix cache, no references; in the cache's LRU) or *referenced*
(refcount >= 1). Taking, referencing and releasing a block are O(1). Block tables live in
:class:`~layerzero.engine.kv.block_manager.KVCacheManager`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from layerzero import LayerZeroError

from .prefix_cache import PrefixCache


class OutOfBlocksError(LayerZeroError, RuntimeError):
    """The KV-cache pool has too few free or evictable blocks for an operation that cannot return None."""


class BlockPool:
    """``num_blocks`` block ids (``0..num_blocks-1``) with refcounts; ``cache`` is the prefix cache (None when
    prefix caching is disabled: released blocks then always go to the free list).

    >>> pool = BlockPool(4, cache=None)
    >>> blocks = pool.take(2)
    >>> pool.incref(blocks)
    >>> blocks, pool.num_free_blocks()
    ([0, 1], 2)
    """

    def __init__(self, num_blocks: int, cache: PrefixCache | None) -> None:
        """``num_blocks`` >= 1 (validated by the manager)."""
        self.num_blocks = num_blocks
        self.cache = cache
        #: Blocks with refcount >= 1.
        self.num_referenced = 0
        #: Cached blocks taken back from the prefix cache for new allocations.
        self.evictions = 0
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks

    def num_free_blocks(self) -> int:
        """Blocks allocation can use: free plus evictable."""
        return len(self._free) + (self.cache.num_evictable() if self.cache is not None else 0)

    def num_evictable_in(self, blocks: Iterable[int]) -> int:
        """How many of ``blocks`` are unreferenced (so referencing them shrinks :meth:`num_free_blocks`)."""
        return sum(1 for b in blocks if self._ref[b] == 0)

    def take(self, n: int) -> list[int]:
        """``n`` blocks with no references and no cached contents: from the free list first (oldest first),
        then by evicting the prefix cache's least-recently-used evictable blocks. Their refcount stays 0 (call
        :meth:`incref`). Raises ``OutOfBlocksError`` (nothing taken) when fewer than ``n`` are left."""
        if n > self.num_free_blocks():
            raise OutOfBlocksError(
                f"BlockPool.take: expected at most {self.num_free_blocks()} blocks (free + evictable), got a "
                f"request for {n}. Check num_free_blocks() first, or free or preempt a request."
            )
        out = [self._free.popleft() for _ in range(min(n, len(self._free)))]
        while len(out) < n:
            block = self.cache.evict()  # type: ignore[union-attr]  # n <= free + evictable
            if block is None:
                raise AssertionError("BlockPool.take: the prefix cache has evictable blocks it cannot evict")
            self.evictions += 1
            out.append(block)
        return out

    def incref(self, blocks: Iterable[int]) -> None:
        """One more reference to each of ``blocks`` (an evictable one leaves the LRU, staying cached)."""
        for block in blocks:
            if self._ref[block] == 0:
                self.num_referenced += 1
                if self.cache is not None and self.cache.is_cached(block):
                    self.cache.acquire(block)
            self._ref[block] += 1

    def decref(self, blocks: Iterable[int]) -> None:
        """One reference less to each of ``blocks``, in the given order: a block left unreferenced joins the
        evictable LRU (most recent end) if cached, else the free list (back)."""
        for block in blocks:
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self.num_referenced -= 1
                if self.cache is not None and self.cache.is_cached(block):
                    self.cache.release(block)
                else:
                    self._free.append(block)

    def drop_evictable(self) -> None:
        """Move every evictable block to the free list (the prefix cache forgets them; not evictions)."""
        while self.cache is not None and (block := self.cache.evict()) is not None:
            self._free.append(block)

    def free_blocks(self) -> list[int]:
        """The free list, next to be handed out first (for tests)."""
        return list(self._free)

    def check_invariants(self, tables: Iterable[list[int]]) -> None:
        """Raise ``AssertionError`` unless refcounts equal the references in ``tables`` (every request's block
        table), free + evictable + referenced partition the blocks, and the prefix cache is consistent."""
        refs = [0] * self.num_blocks
        for table in tables:
            for block in table:
                refs[block] += 1
        referenced = [b for b in range(self.num_blocks) if refs[b]]
        if refs != self._ref or len(referenced) != self.num_referenced:
            raise AssertionError("BlockPool: refcounts disagree with the block tables")
        evictable = self.cache.evictable_blocks() if self.cache is not None else []
        states = [*self._free, *evictable, *referenced]
        if len(states) != self.num_blocks or set(states) != set(range(self.num_blocks)):
            raise AssertionError(
                f"BlockPool: free {len(self._free)} + evictable {len(evictable)} + referenced "
                f"{len(referenced)} blocks do not partition the {self.num_blocks} blocks"
            )
        if self.cache is not None:
            if any(self.cache.is_cached(b) for b in self._free):
                raise AssertionError("BlockPool: a free block is still registered in the prefix cache")
            self.cache.check_invariants()
