"""Prefix caches over full KV blocks: the interface both kinds share, and vLLM's chained block hash.

A prefix cache maps token prefixes that end on a block boundary to the block id holding the last block of
that prefix, so a new request whose prompt starts with a cached prefix reuses those blocks instead of
recomputing them. It also keeps the LRU of *evictable* blocks: cached blocks no request references, that
allocation may take back (the cache then forgets them).

Two kinds implement :class:`PrefixCache`: :class:`HashPrefixCache` (this module; vLLM v1's chained block
hash) and :class:`~layerzero.engine.kv.radix_cache.RadixCache` (SGLang's radix tree with page size =
block size). For the same calls both cache the same prefixes and evict the same blocks.

Registration rule (both kinds): a request's blocks are registered in order from its first block; a block
whose prefix is already cached by *another* block id stays private, and so do all the request's later
blocks (their prefixes run through that private block). So every cached block's shorter prefixes are cached
by the same request's earlier blocks, which that request references whenever it references the block: an
unreferenced cached block only ever has unreferenced cached descendants, and evicting in LRU order (a
request's blocks are released tail first) removes descendants before their ancestors.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from layerzero import InvalidInputError

#: Parent digest of a request's first block.
ROOT_HASH = hashlib.sha256(b"layerzero.engine.kv root").digest()


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """Prefix-cache counters since the manager was built. ``queries``/``hits``: tokens looked up / found
    cached by recorded lookups; ``evictions``: cached blocks taken back for new allocations;
    ``num_cached_blocks``: blocks registered now (referenced or evictable)."""

    queries: int
    hits: int
    evictions: int
    num_cached_blocks: int

    @property
    def hit_rate(self) -> float:
        """``hits / queries`` (0.0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0


class PrefixCache(Protocol):
    """What :class:`~layerzero.engine.kv.block_manager.KVCacheManager` needs from a prefix cache.

    Units: ``token_ids`` are token ids, ``blocks`` are block ids; block ``i`` of a request holds tokens
    ``[i * block_size, (i + 1) * block_size)``. Only full blocks are ever cached.
    """

    block_size: int

    def match(self, token_ids: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix of ``token_ids`` made of full blocks (no side effects)."""
        ...

    def insert(self, token_ids: Sequence[int], blocks: Sequence[int], start: int = 0) -> int:
        """Register ``blocks[i]`` as holding full block ``i`` of ``token_ids``, for ``i`` from ``start``
        (blocks before ``start`` must already be registered, by this request) up to the last full block.
        Stops at the first block whose prefix another block id holds. Returns how many leading blocks are
        now registered."""
        ...

    def is_cached(self, block: int) -> bool:
        """Whether ``block`` is registered."""
        ...

    def num_cached_blocks(self) -> int:
        """Number of registered blocks (referenced or evictable)."""
        ...

    def release(self, block: int) -> None:
        """A registered block lost its last reference: it joins the evictable LRU (most recent end)."""
        ...

    def acquire(self, block: int) -> None:
        """An evictable block is referenced again: it leaves the evictable LRU (stays registered)."""
        ...

    def evict(self) -> int | None:
        """Forget the least-recently-used evictable block and return its id (None when none is evictable)."""
        ...

    def num_evictable(self) -> int:
        """Number of evictable blocks."""
        ...

    def evictable_blocks(self) -> list[int]:
        """Evictable block ids, least recently used first."""
        ...

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the cache's internal structures disagree."""
        ...


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """vLLM's chained block hash: sha256 of the parent block's digest and this block's token ids (int64).

    The digest names the whole prefix up to and including this block. sha256 rather than Python's ``hash``
    of tuples: 256 bits make an accidental collision (which would serve one prompt another prompt's KV)
    practically impossible, and token ids chosen by users cannot be crafted to collide, unlike the 64-bit
    tuple hash. It costs about 1 us per block.

    >>> len(block_hash(ROOT_HASH, [1, 2, 3, 4]))
    32
    """
    try:
        data = array("q", tokens).tobytes()
    except (OverflowError, TypeError) as e:
        raise InvalidInputError(
            f"block_hash: expected token ids as ints in the int64 range, got {list(tokens)!r} ({e}). "
            "Pass the tokenizer's integer ids."
        ) from None
    return hashlib.sha256(parent + data).digest()


def _chunks(token_ids: Sequence[int], block_size: int, start: int, stop: int) -> Iterator[Sequence[int]]:
    """Full blocks ``start..stop-1`` of ``token_ids``."""
    for i in range(start, stop):
        yield token_ids[i * block_size : (i + 1) * block_size]


class HashPrefixCache:
    """Prefix cache keyed by chained block hashes (vLLM v1 ``BlockPool.cached_block_hash_to_block``).

    ``digest -> block`` and ``block -> digest`` dicts plus an ``OrderedDict`` LRU of evictable blocks: lookup,
    registration, release, reacquire and eviction are O(1) per block (match and insert hash each block once).

    >>> cache = HashPrefixCache(block_size=2)
    >>> cache.insert([1, 2, 3, 4, 5], blocks=[7, 9])
    2
    >>> cache.match([1, 2, 3, 4, 5, 6])
    [7, 9]
    """

    def __init__(self, block_size: int) -> None:
        """``block_size``: tokens per block (>= 1; validated by the manager)."""
        self.block_size = block_size
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()

    def match(self, token_ids: Sequence[int]) -> list[int]:
        """Block ids of the longest cached full-block prefix of ``token_ids``."""
        out: list[int] = []
        parent = ROOT_HASH
        for chunk in _chunks(token_ids, self.block_size, 0, len(token_ids) // self.block_size):
            parent = block_hash(parent, chunk)
            block = self._block_of.get(parent)
            if block is None:
                break
            out.append(block)
        return out

    def insert(self, token_ids: Sequence[int], blocks: Sequence[int], start: int = 0) -> int:
        """Register full blocks ``start..`` of ``token_ids`` (see :meth:`PrefixCache.insert`)."""
        stop = min(len(blocks), len(token_ids) // self.block_size)
        if start >= stop:
            return start
        parent = ROOT_HASH if start == 0 else self._hash_of.get(blocks[start - 1])
        if parent is None:
            raise InvalidInputError(
                f"HashPrefixCache.insert: expected blocks[{start - 1}] (block {blocks[start - 1]}) to be "
                f"registered before registering from start={start}, got an unregistered block. Insert from 0."
            )
        for i, chunk in enumerate(_chunks(token_ids, self.block_size, start, stop), start):
            digest = block_hash(parent, chunk)
            owner = self._block_of.get(digest)
            if owner is None:
                if blocks[i] in self._hash_of:
                    raise InvalidInputError(
                        f"HashPrefixCache.insert: block {blocks[i]} is already registered for another "
                        "prefix; expected each block id to hold one prefix. Pass the request's own block "
                        "table."
                    )
                self._block_of[digest] = blocks[i]
                self._hash_of[blocks[i]] = digest
            elif owner != blocks[i]:
                return i
            parent = digest
        return stop

    def is_cached(self, block: int) -> bool:
        """Whether ``block`` is registered."""
        return block in self._hash_of

    def num_cached_blocks(self) -> int:
        """Number of registered blocks."""
        return len(self._hash_of)

    def release(self, block: int) -> None:
        """``block`` (registered) joins the evictable LRU at the most-recent end."""
        self._lru[block] = None

    def acquire(self, block: int) -> None:
        """``block`` leaves the evictable LRU."""
        del self._lru[block]

    def evict(self) -> int | None:
        """Forget the least-recently-used evictable block; return it (None if none)."""
        if not self._lru:
            return None
        block, _ = self._lru.popitem(last=False)
        del self._block_of[self._hash_of.pop(block)]
        return block

    def num_evictable(self) -> int:
        """Number of evictable blocks."""
        return len(self._lru)

    def evictable_blocks(self) -> list[int]:
        """Evictable block ids, least recently used first."""
        return list(self._lru)

    def check_invariants(self) -> None:
        """The two dicts are inverse of each other and every evictable block is registered."""
        if len(self._block_of) != len(self._hash_of) or any(
            self._hash_of.get(b) != h for h, b in self._block_of.items()
        ):
            raise AssertionError("HashPrefixCache: digest->block and block->digest maps disagree")
        missing = [b for b in self._lru if b not in self._hash_of]
        if missing:
            raise AssertionError(f"HashPrefixCache: evictable blocks {missing} are not registered")
