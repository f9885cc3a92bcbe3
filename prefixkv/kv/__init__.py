"""Paged KV-cache bookkeeping: block pool, radix prefix index, per-request block tables. No torch."""

from prefixkv.kv.block_pool import BlockPool
from prefixkv.kv.manager import CopyOp, KVCacheManager
from prefixkv.kv.radix import MatchResult, RadixIndex

__all__ = ["BlockPool", "CopyOp", "KVCacheManager", "MatchResult", "RadixIndex"]
