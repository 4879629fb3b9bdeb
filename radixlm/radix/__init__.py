"""KV memory: physical pages (``BlockPool``) and the prefix-sharing radix tree (``RadixCache``)."""

from __future__ import annotations

from radixlm.radix.block_pool import BlockPool, OutOfPagesError
from radixlm.radix.hicache import HiCache, HiCacheStats, TierFollowers
from radixlm.radix.radix_cache import CacheStats, MatchResult, RadixCache, TreeNode
from radixlm.radix.swa_pool import HybridBlockPool
from radixlm.radix.tier import FileTierStore, HostTierStore, TierStore, open_file_store
from radixlm.radix.tier_shard import PageIO, TierShard

__all__ = [
    "BlockPool",
    "CacheStats",
    "FileTierStore",
    "HiCache",
    "HiCacheStats",
    "HostTierStore",
    "HybridBlockPool",
    "MatchResult",
    "OutOfPagesError",
    "PageIO",
    "RadixCache",
    "TierFollowers",
    "TierShard",
    "TierStore",
    "TreeNode",
    "open_file_store",
]
