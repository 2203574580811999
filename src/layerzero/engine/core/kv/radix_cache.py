"""SGLang's RadixAttention prefix cache with page size = block size: a tree over block-sized token chunks.

Each node below the root holds one full block: its key is the block's tuple of token ids, its path from the
root spells the prefix the block ends, and ``children`` maps the next block's tokens to the next node. A
lookup walks the tree chunk by chunk; registration extends the path. Eviction is leaf first: the
least-recently-released evictable node *without children* goes first, so a node is never evicted before its
descendants (SGLang ``RadixCache.evict``, with an LRU list in place of a heap of access times).

Registration follows the rule in :mod:`~layerzero.engine.kv.prefix_cache` (a block whose prefix another
block holds stays private, and so do the request's later blocks), so an unreferenced node never has a
referenced descendant and every evictable node can eventually be evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from layerzero import InvalidInputError


class _Node:
    """One full block in the tree: ``key`` (its tokens), ``block`` (its id), ``parent``, ``children``."""

    __slots__ = ("key", "block", "parent", "children")

    def __init__(self, key: tuple[int, ...], block: int, parent: _Node | None) -> None:
        self.key = key
        self.block = block
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}


class RadixCache:
    """Radix-tree prefix cache (implements :class:`~layerzero.engine.kv.prefix_cache.PrefixCache`).

    Match and insert cost O(1) dict lookups per block (each hashes a ``block_size``-tuple); release,
    reacquire and eviction are O(1) (eviction skips evictable nodes that still have children, which the
    manager's release order makes rare).

    >>> cache = RadixCache(block_size=2)
    >>> cache.insert([1, 2, 3, 4], blocks=[7, 9])
    2
    >>> cache.match([1, 2, 3, 5])
    [7]
    """

    def __init__(self, block_size: int) -> None:
        """``block_size``: tokens per block, one tree edge (>= 1; validated by the manager)."""
        self.block_size = block_size
        self._root = _Node((), -1, None)
        self._node_of: dict[int, _Node] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()

    def _chunk(self, token_ids: Sequence[int], i: int) -> tuple[int, ...]:
        """Tokens of full block ``i`` as a tuple (the child key)."""
        return tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])

    def match(self, token_ids: Sequence[int]) -> list[int]:
        """Block ids on the longest tree path spelling a full-block prefix of ``token_ids``."""
        out: list[int] = []
        node = self._root
        for i in range(len(token_ids) // self.block_size):
            child = node.children.get(self._chunk(token_ids, i))
            if child is None:
                break
            out.append(child.block)
            node = child
        return out

    def insert(self, token_ids: Sequence[int], blocks: Sequence[int], start: int = 0) -> int:
        """Extend the tree with full blocks ``start..`` of ``token_ids`` (see :meth:`PrefixCache.insert`)."""
        stop = min(len(blocks), len(token_ids) // self.block_size)
        if start >= stop:
            return start
        node = self._root if start == 0 else self._node_of.get(blocks[start - 1])
        if node is None:
            raise InvalidInputError(
                f"RadixCache.insert: expected blocks[{start - 1}] (block {blocks[start - 1]}) to be in the "
                f"tree before inserting from start={start}, got an unregistered block. Insert from 0."
            )
        for i in range(start, stop):
            key = self._chunk(token_ids, i)
            child = node.children.get(key)
            if child is None:
                if blocks[i] in self._node_of:
                    raise InvalidInputError(
                        f"RadixCache.insert: block {blocks[i]} is already in the tree for another prefix; "
                        "expected each block id to hold one prefix. Pass the request's own block table."
                    )
                child = _Node(key, blocks[i], node)
                node.children[key] = child
                self._node_of[blocks[i]] = child
            elif child.block != blocks[i]:
                return i
            node = child
        return stop

    def is_cached(self, block: int) -> bool:
        """Whether ``block`` is a node of the tree."""
        return block in self._node_of

    def num_cached_blocks(self) -> int:
        """Number of nodes (blocks) in the tree."""
        return len(self._node_of)

    def release(self, block: int) -> None:
        """``block``'s node (unreferenced now) joins the evictable LRU at the most-recent end."""
        self._lru[block] = None

    def acquire(self, block: int) -> None:
        """``block``'s node is referenced again: it leaves the evictable LRU."""
        del self._lru[block]

    def evict(self) -> int | None:
        """Remove the least-recently-released evictable *leaf*; return its block (None if none)."""
        for block in self._lru:
            node = self._node_of[block]
            if not node.children:
                del self._lru[block]
                del self._node_of[block]
                del node.parent.children[node.key]  # type: ignore[union-attr]
                return block
        return None

    def num_evictable(self) -> int:
        """Number of evictable nodes (unreferenced; all of them can be evicted, leaves first)."""
        return len(self._lru)

    def evictable_blocks(self) -> list[int]:
        """Evictable block ids, least recently released first."""
        return list(self._lru)

    def check_invariants(self) -> None:
        """Parent/child links agree, every node is indexed by its block, and an evictable node's children are
        all evictable (so evicting leaves first can empty the LRU)."""
        seen = 0
        stack = [self._root]
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                if child.parent is not node or child.key != key or len(key) != self.block_size:
                    raise AssertionError(f"RadixCache: node of block {child.block} is linked inconsistently")
                if self._node_of.get(child.block) is not child:
                    raise AssertionError(f"RadixCache: block {child.block} is not indexed to its node")
                if child.block in self._lru and any(
                    c.block not in self._lru for c in child.children.values()
                ):
                    raise AssertionError(f"RadixCache: evictable block {child.block} has a referenced child")
                stack.append(child)
                seen += 1
        if seen != len(self._node_of):
            raise AssertionError(f"RadixCache: {len(self._node_of)} blocks indexed, {seen} nodes in the tree")
        missing = [b for b in self._lru if b not in self._node_of]
        if missing:
            raise AssertionError(f"RadixCache: evictable blocks {missing} are not in the tree")
