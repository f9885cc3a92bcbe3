"""Paged KV-cache bookkeeping: the block pool, one manager per attention type (the radix index for
full attention), the coordinator the scheduler talks to, and the host/disk tiers' scheduler side.
No torch."""

from prefixkv.kv.block_pool import BlockPool
from prefixkv.kv.coordinator import CopyOp, KVCacheCoordinator, TableDelta
from prefixkv.kv.radix import MatchResult, RadixIndex
from prefixkv.kv.tiers import TierConnector, TierPlan

__all__ = ["BlockPool", "CopyOp", "KVCacheCoordinator", "MatchResult", "RadixIndex", "TableDelta", "TierConnector",
           "TierPlan"]
