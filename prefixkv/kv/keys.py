"""The cache key of a KV block and of its pages. No torch.

A block's key is its chain hash (``kv.hashing.block_hash``): of the block before it and its own
tokens, so equal keys mean equal prefixes (up to collisions, which every cache checks against the
block's own tokens). A page is one KV cache group's KV of a block (kv/groups.py) and is keyed by
``(block hash, group)``: the device caches, the host and disk tiers and the router's digest all use
these keys.

A request's block hashes are computed once, as its blocks fill (``hash_blocks`` extends a list the
caller keeps: ``Request.block_hashes``).

Tenants: the chain of a request with a ``cache_salt`` or a cache partition (the server's, from the
API key that authenticated it) starts from ``cache_root(salt, partition)`` instead of 0, so none of
its blocks has the key of another salt's or partition's block: not in the device index (whose
first level is keyed by the root too: kv/radix.py), the host tier, the disk files (the same after
a restart: the root is a SHA-256 of the salt, not Python's per-process ``hash`` of a str), nor in
the digests the router matches (serve/digest.py computes a prompt's keys with the same function).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from prefixkv.kv.hashing import block_hash, first_block_keys, fold_keys

PageKey = tuple[int, int]  # (block hash, KV cache group)


def cache_root(cache_salt: str | None = None, partition: str | None = None) -> int:
    """The parent of a request's first block: 0 for neither (every unsalted request of the
    server's one partition shares it), else an int64 of both (``hashing.first_block_keys``)."""
    return fold_keys(first_block_keys(cache_salt, partition))


def hash_blocks(token_ids: Sequence[int], hashes: list[int], num_blocks: int, block_size: int,
                root: int = 0) -> list[int]:
    """Extend ``hashes`` (the chain hashes of the first ``len(hashes)`` blocks of ``token_ids``,
    starting from ``root``: ``cache_root``) in place to the first ``num_blocks`` blocks; returns it."""
    prev = hashes[-1] if hashes else root
    for i in range(len(hashes), num_blocks):
        prev = block_hash(prev, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(prev)
    return hashes


class EvictedPage(NamedTuple):
    """A page a device cache let go of: its KV stays valid until the step's copies have run."""

    page: int
    key: PageKey
    tokens: tuple[int, ...]


class LowerPage(NamedTuple):
    """A page of a prefix hit that a lower tier (host or disk) supplies: copied into a fresh device
    page before the step that reads it."""

    group: int
    index: int  # the block's index in the request's table
    key: PageKey
    tokens: tuple[int, ...]
