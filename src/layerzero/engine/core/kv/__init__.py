"""KV-cache block bookkeeping for the engine: the block pool and its two prefix-cache kinds.

:class:`KVCacheManager` owns the block tables (prefix-cache lookups, copy-on-write forks) over a
:class:`BlockPool` (free list, refcounts);
:class:`HashPrefixCache` (vLLM chained block hashes) and :class:`RadixCache` (SGLang radix tree) implement
:class:`PrefixCache`. Pure Python: block ids only, the KV tensors live with the model runner.
"""

from .block_manager import PREFIX_CACHE_KINDS, KVCacheManager
from .block_pool import BlockPool, OutOfBlocksError
from .prefix_cache import ROOT_HASH, HashPrefixCache, PrefixCache, PrefixCacheStats, block_hash
from .radix_cache import RadixCache

__all__ = [
    "PREFIX_CACHE_KINDS",
    "ROOT_HASH",
    "BlockPool",
    "HashPrefixCache",
    "KVCacheManager",
    "OutOfBlocksError",
    "PrefixCache",
    "PrefixCacheStats",
    "RadixCache",
    "block_hash",
]
