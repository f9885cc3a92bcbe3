"""What a replica's prefix cache holds, in the form a router can match a request against (no torch,
no Ray).

A replica publishes its ``KVCacheCoordinator.cache_digest()``: the chain hash (``kv.hashing.block_hash``)
of every full block it holds, with its tier. A request's prompt token ids hash into the same chain,
block by block (from the root of its cache salt and partition, as in the engine, so a request
matches only its own tenant's blocks); the blocks a replica can serve from cache are the longest run of leading hashes
found in its digest. As in the engine, the block holding the prompt's last token never counts (that
token is always computed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from prefixkv.kv.keys import hash_blocks
from prefixkv.kv.tiers import TIER_DEVICE


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, root: int = 0) -> list[int]:
    """The chain hashes of the prompt's full blocks that a prefix hit can cover, from ``root``
    (``kv.keys.cache_root`` of its salt and partition, as the engine's ``Request.cache_root``)."""
    return hash_blocks(token_ids, [], (len(token_ids) - 1) // block_size, block_size, root)


class PrefixMatch(NamedTuple):
    num_blocks: int  # leading blocks held in any tier
    num_device_blocks: int  # of those, in device memory (no copy needed)


def match_digest(hashes: Sequence[int], digest: Mapping[int, int]) -> PrefixMatch:
    n = dev = 0
    for h in hashes:
        tier = digest.get(h)
        if tier is None:
            break
        n += 1
        dev += tier == TIER_DEVICE
    return PrefixMatch(n, dev)


def bounded_digest(digest: Mapping[int, int], retained: Sequence[int], max_blocks: int) -> dict[int, int]:
    """``digest`` cut to ``max_blocks`` entries: the retained blocks first (what the replica keeps
    whatever else it evicts), then by tier, the device's first."""
    if len(digest) <= max_blocks:
        return dict(digest)
    keep = set(retained)
    order = sorted(digest.items(), key=lambda kv: (kv[0] not in keep, kv[1]))
    return dict(order[:max_blocks])
