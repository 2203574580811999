"""The KV-cache manager: per-request block tables over a :class:`BlockPool`, prefix caching, forks.

Follows vLLM v1's ``KVCacheManager`` (chained-hash prefix caching, tail-first release, LRU eviction of
unreferenced cached blocks, never a hit on the whole prompt) with SGLang's radix tree as the other
prefix-cache kind. Pure bookkeeping: block ids only; the KV tensors live with the model runner.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from layerzero import ConfigurationError, InvalidInputError

from .block_pool import BlockPool, OutOfBlocksError
from .prefix_cache import HashPrefixCache, PrefixCacheStats
from .radix_cache import RadixCache
from .table_mirror import BlockTableMirror

#: Prefix-cache kinds by name: ``"hash"`` (vLLM chained block hashes), ``"radix"`` (SGLang radix tree).
PREFIX_CACHE_KINDS: dict[str, type[HashPrefixCache] | type[RadixCache]] = {
    "hash": HashPrefixCache,
    "radix": RadixCache,
}

_INF = float("inf")


def _check_int(what: str, value: object, low: int, high: float, error: type[Exception], fix: str) -> int:
    """``value`` as an int in ``[low, high]``, else ``error`` saying ``what`` failed and how to ``fix`` it."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        expected = f">= {low}" if high == _INF else f"in [{low}, {high}]"
        raise error(f"{what}: expected an int {expected}, got {value!r}. {fix}")
    return value


class KVCacheManager:
    """Blocks of ``block_size`` tokens in a pool of ``num_blocks`` (ids ``0..num_blocks-1``), per-request
    block tables (block ``i`` of a request holds its tokens ``[i*block_size, (i+1)*block_size)``).

    Allocation and release are O(1) per block (see :class:`BlockPool`). ``prefix_cache``: ``"hash"`` or
    ``"radix"`` (same hits and evictions; see :mod:`~layerzero.engine.kv.prefix_cache`); ``watermark``: the
    fraction of ``num_blocks`` that admission (``admit=True``) keeps free for running requests. Raises
    ``ConfigurationError`` for ``num_blocks < 1``, ``block_size < 1``, an unknown ``prefix_cache`` or a
    ``watermark`` outside ``[0, 1)``.

    >>> kv = KVCacheManager(num_blocks=8, block_size=4)
    >>> prompt = list(range(10))
    >>> blocks, n = kv.get_computed_blocks(prompt)
    >>> kv.allocate_slots("a", len(prompt), blocks)
    [0, 1, 2]
    >>> kv.cache_blocks("a", prompt, num_computed_tokens=10)
    >>> kv.free("a")
    >>> kv.get_computed_blocks(prompt)
    ([0, 1], 8)
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        prefix_cache: str = "hash",
        watermark: float = 0.01,
    ) -> None:
        """See the class docstring."""
        fix = "Size the pool from the memory left after loading the weights."
        self.num_blocks = _check_int(
            "KVCacheManager: num_blocks", num_blocks, 1, _INF, ConfigurationError, fix
        )
        fix = "Use the block size the KV cache tensors were allocated with (e.g. 16)."
        self.block_size = _check_int(
            "KVCacheManager: block_size", block_size, 1, _INF, ConfigurationError, fix
        )
        if prefix_cache not in PREFIX_CACHE_KINDS:
            raise ConfigurationError(
                f"KVCacheManager: prefix_cache: expected one of {sorted(PREFIX_CACHE_KINDS)}, got "
                f"{prefix_cache!r}. Use 'hash' (vLLM) or 'radix' (SGLang)."
            )
        if isinstance(watermark, bool) or not isinstance(watermark, int | float) or not 0 <= watermark < 1:
            raise ConfigurationError(
                f"KVCacheManager: watermark: expected a fraction in [0, 1), got {watermark!r}. "
                "Use a small fraction such as 0.01 (or 0 to admit until the pool is full)."
            )
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.prefix_cache = prefix_cache
        self.watermark = float(watermark)
        #: Blocks that admission (``admit=True``) leaves free for running requests.
        self.watermark_blocks = int(self.watermark * num_blocks)
        cache = PREFIX_CACHE_KINDS[prefix_cache](block_size) if self.enable_prefix_caching else None
        self.pool = BlockPool(num_blocks, cache)
        self._cache = cache
        self._tables: dict[Hashable, list[int]] = {}
        self._mirror = BlockTableMirror()  # the same tables as numpy rows (block_tables)
        self._num_cached: dict[Hashable, int] = {}  # leading table blocks registered in the prefix cache
        self._cache_stopped: set[Hashable] = set()  # requests whose next block duplicates a cached one
        self._queries = self._hits = 0

    def get_computed_blocks(self, token_ids: Sequence[int], *, record: bool = True) -> tuple[list[int], int]:
        """Longest cached prefix of ``token_ids`` made of full blocks: (block ids, tokens they hold).

        Never the whole prompt: at most ``len(token_ids) - 1`` tokens (the last token must be computed to
        get logits), rounded down to a block boundary. No side effects on refcounts or the LRU; counts
        toward :meth:`stats` when ``record``. Prefix caching disabled: ``([], 0)``, nothing recorded."""
        if self._cache is None:
            return [], 0
        max_blocks = max(len(token_ids) - 1, 0) // self.block_size
        blocks = self._cache.match(token_ids[: max_blocks * self.block_size]) if max_blocks else []
        num_tokens = len(blocks) * self.block_size
        if record:
            self._queries += len(token_ids)
            self._hits += num_tokens
        return blocks, num_tokens

    def allocate_slots(
        self, req_id: Hashable, num_tokens: int, computed_blocks: Sequence[int] = (), *, admit: bool = False
    ) -> list[int] | None:
        """Make ``req_id``'s block table hold ``num_tokens`` tokens in total (``ceil(num_tokens /
        block_size)`` blocks) and return the NEW block ids appended (``[]`` if it already does).

        On the first call for a request, ``computed_blocks`` (from :meth:`get_computed_blocks`, with no
        allocation in between) start its table: refcount +1 each, evictable ones leave the LRU. New blocks
        come from the free list, else by evicting least-recently-used unreferenced cached blocks. Returns
        None with nothing changed when too few blocks are left; with ``admit=True`` it also keeps
        ``watermark_blocks`` free. Raises ``InvalidInputError`` for a negative ``num_tokens``, computed
        blocks on a later call, fewer tokens than the computed blocks hold, or computed blocks that are
        not cached (a stale lookup)."""
        table = self._tables.get(req_id)
        if (
            table is not None
            and not len(computed_blocks)
            and type(num_tokens) is int
            and 0 <= num_tokens <= len(table) * self.block_size
        ):
            # the table holds them already: most decode steps (one new block every block_size steps)
            return []
        what = f"allocate_slots({req_id!r})"
        _check_int(
            f"{what}: num_tokens", num_tokens, 0, _INF, InvalidInputError, "It counts tokens in total."
        )
        computed = list(computed_blocks)
        if computed:
            self._check_computed(what, table is None, computed, num_tokens)
        num_new = max(-(-num_tokens // self.block_size) - len(table if table is not None else computed), 0)
        available = self.pool.num_free_blocks() - self.pool.num_evictable_in(computed)
        if num_new > available - (self.watermark_blocks if admit else 0):
            return None
        if table is None:
            self.pool.incref(computed)
            table = self._tables[req_id] = computed
            self._num_cached[req_id] = len(computed)
            self._mirror.assign(req_id, computed)
        new = self.pool.take(num_new)
        self.pool.incref(new)
        table.extend(new)
        self._mirror.extend(req_id, new)
        return new

    def _check_computed(self, what: str, first: bool, computed: list[int], num_tokens: int) -> None:
        """Validate ``computed_blocks``: a first allocation, distinct cached blocks, within ``num_tokens``."""
        if not first:
            raise InvalidInputError(
                f"{what}: computed_blocks: expected none for a request that already has a block table, got "
                f"{computed}. Pass computed blocks only on the request's first call."
            )
        cache = self._cache
        if cache is None or len(set(computed)) != len(computed) or not all(map(cache.is_cached, computed)):
            raise InvalidInputError(
                f"{what}: computed_blocks: expected distinct cached blocks from get_computed_blocks, got "
                f"{computed}. Look them up again right before allocating."
            )
        fix = "The table must hold at least the computed blocks' tokens."
        _check_int(
            f"{what}: num_tokens", num_tokens, len(computed) * self.block_size, _INF, InvalidInputError, fix
        )

    def cache_blocks(self, req_id: Hashable, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register ``req_id``'s blocks that are now full (``num_computed_tokens`` covers them) in the prefix
        cache, keyed by all tokens up to and including each block. Incremental: blocks registered by an
        earlier call are not hashed again. A block whose prefix another block already holds stays private,
        and so do the request's later blocks (no dedup). No-op when prefix caching is disabled."""
        table = self._table(req_id, "cache_blocks")
        if self._cache is None or req_id in self._cache_stopped:
            return
        num_full = min(min(num_computed_tokens, len(token_ids)) // self.block_size, len(table))
        start = self._num_cached[req_id]
        if num_full > start:
            registered = self._num_cached[req_id] = self._cache.insert(token_ids, table[:num_full], start)
            if registered < num_full:
                self._cache_stopped.add(req_id)

    def free(self, req_id: Hashable) -> None:
        """Drop ``req_id``'s references in reverse table order (the tail becomes least recently used, so it
        is evicted first): a block left at refcount 0 becomes evictable if cached, else free. Raises
        ``InvalidInputError`` for an unknown request."""
        self.pool.decref(reversed(self._table(req_id, "free")))
        del self._tables[req_id], self._num_cached[req_id]
        self._mirror.release(req_id)
        self._cache_stopped.discard(req_id)

    def fork(self, parent_id: Hashable, child_id: Hashable, num_tokens: int) -> list[tuple[int, int]]:
        """Start ``child_id`` from ``parent_id``'s first ``num_tokens`` tokens, copy-on-write ready: the child
        shares the parent's full blocks (refcount +1) and gets a new block for the partial last one.

        Returns ``[(src_block, dst_block)]``: the block copies the caller must perform on the KV tensors
        (empty when ``num_tokens`` ends on a block boundary). Raises ``OutOfBlocksError`` (nothing changed)
        when no block is left for the copy, ``InvalidInputError`` for an unknown parent, an existing child
        or ``num_tokens`` outside ``[0, tokens the parent's table holds]``."""
        parent = self._table(parent_id, "fork")
        what = f"fork({parent_id!r}, {child_id!r})"
        if child_id in self._tables:
            raise InvalidInputError(
                f"{what}: expected a new child id, got one with a block table. Free it first."
            )
        fix = "Fork at most the tokens the parent's block table holds."
        _check_int(
            f"{what}: num_tokens", num_tokens, 0, len(parent) * self.block_size, InvalidInputError, fix
        )
        num_full, partial = divmod(num_tokens, self.block_size)
        if partial and self.pool.num_free_blocks() < 1:
            raise OutOfBlocksError(
                f"{what}: expected 1 free or evictable block for the copy of the partial last block, got 0. "
                "Free or preempt a request first."
            )
        table = self._tables[child_id] = parent[:num_full] + self.pool.take(1 if partial else 0)
        self.pool.incref(table)
        self._mirror.assign(child_id, table)
        parent_cached = self._num_cached[parent_id]
        self._num_cached[child_id] = min(parent_cached, num_full)
        if parent_id in self._cache_stopped and parent_cached < num_full:
            self._cache_stopped.add(child_id)
        return [(parent[num_full], table[-1])] if partial else []

    def reset_prefix_cache(self) -> bool:
        """Drop every cached, unreferenced block to the free list (e.g. after a weight update). Returns True
        when the prefix cache is now empty, False when cached blocks are still referenced (they stay)."""
        self.pool.drop_evictable()
        return self._cache is None or self._cache.num_cached_blocks() == 0

    def _table(self, req_id: Hashable, what: str) -> list[int]:
        """``req_id``'s table or an InvalidInputError naming the call ``what``."""
        table = self._tables.get(req_id)
        if table is None:
            raise InvalidInputError(
                f"{what}({req_id!r}): expected a request with a block table, got an unknown id. Call "
                "allocate_slots first (check `req_id in manager`)."
            )
        return table

    def __contains__(self, req_id: Hashable) -> bool:
        """Whether ``req_id`` has a block table."""
        return req_id in self._tables

    def block_table(self, req_id: Hashable) -> list[int]:
        """A copy of ``req_id``'s block ids, in token order."""
        return list(self._table(req_id, "block_table"))

    def block_tables(self, req_ids: Sequence[Hashable]) -> np.ndarray:
        """``[B, W]`` int32: the block tables of ``req_ids`` (B of them, in order) as one matrix, each row
        padded with 0 to the longest table's W blocks (W >= 1); a new array. One gather from a numpy mirror of
        the tables (:class:`~.table_mirror.BlockTableMirror`), not a list copy per request. Raises
        ``InvalidInputError`` for an id without a block table."""
        try:
            return self._mirror.gather(req_ids)
        except KeyError as exc:
            self._table(exc.args[0], "block_tables")  # raises InvalidInputError naming the id
            raise

    def num_free_blocks(self) -> int:
        """Blocks allocation can use: free plus evictable."""
        return self.pool.num_free_blocks()

    def usage(self) -> float:
        """Fraction of the pool's blocks referenced by requests (0.0..1.0)."""
        return self.pool.num_referenced / self.num_blocks

    def can_allocate(self, num_new_blocks: int, *, admit: bool = False) -> bool:
        """Whether ``num_new_blocks`` new blocks fit (keeping ``watermark_blocks`` free when ``admit``)."""
        return num_new_blocks <= self.pool.num_free_blocks() - (self.watermark_blocks if admit else 0)

    def stats(self) -> PrefixCacheStats:
        """Prefix-cache counters (tokens queried and hit, evictions, cached blocks)."""
        cached = self._cache.num_cached_blocks() if self._cache is not None else 0
        return PrefixCacheStats(self._queries, self._hits, self.pool.evictions, cached)

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` unless every block is in exactly one of free / evictable / referenced,
        refcounts equal the block tables' references and the prefix cache is consistent (for tests)."""
        self.pool.check_invariants(self._tables.values())
        for req, table in self._tables.items():
            if self._cache is not None and not all(
                map(self._cache.is_cached, table[: self._num_cached[req]])
            ):
                raise AssertionError(f"KVCacheManager: request {req!r}'s registered blocks left the cache")
        if self._tables:
            ids = list(self._tables)
            got, width = self._mirror.gather(ids), max(map(len, self._tables.values()))
            want = np.zeros((len(ids), max(width, 1)), dtype=np.int32)
            for i, t in enumerate(self._tables.values()):
                want[i, : len(t)] = t
            if not np.array_equal(got, want):
                raise AssertionError(
                    "KVCacheManager: the numpy mirror of the block tables differs from the tables"
                )
