"""KV memory: physical pages (``BlockPool``) and the prefix-sharing radix tree (``RadixCache``)."""

from __future__ import annotations

from radixlm.radix.block_pool import BlockPool, OutOfPagesError
from radixlm.radix.radix_cache import CacheStats, MatchResult, RadixCache, TreeNode

__all__ = ["BlockPool", "CacheStats", "MatchResult", "OutOfPagesError", "RadixCache", "TreeNode"]
