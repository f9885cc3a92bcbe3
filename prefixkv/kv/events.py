"""KV cache events as plain data (no torch, no msgspec): what the cache tells routers it stored
and dropped, in vLLM's vocabulary. ``prefixkv/kv_events.py`` turns them into vLLM's wire structs
and publishes them.

Media, vLLM's names for where a copy of a block lives:

* ``GPU``: the device pool, the blocks attention reads in place, whatever the device. On a CPU
  machine it is host memory, and still "GPU": vLLM's own CPU backend publishes its KV cache
  under that name (its block pool has no other), and consumers (llm-d, Dynamo) take "GPU" for
  the tier a request is served from without a copy.
* ``CPU``: the host tier (``kv/host_cache.py``), vLLM's CPU offloading medium: a hit copies in.
* ``STORAGE``: the disk tier (``kv/disk_cache.py``), vLLM's file-system offloading medium.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

from prefixkv.kv.hashing import BlockHash, BlockHasher, ExtraKeys

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
FULL_ATTENTION = "full_attention"  # vLLM's KVCacheSpecKind values
SLIDING_WINDOW = "sliding_window"


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A run of full blocks, each continuing the one before, stored in ``medium``. Hashes are in
    their published form (``BlockHasher.external``)."""

    block_hashes: tuple[int | bytes, ...]
    parent_block_hash: int | bytes | None  # None: the run starts the prompt, or its parent is not told
    token_ids: tuple[int, ...]  # len(block_hashes) * block_size of them
    block_size: int
    medium: str
    extra_keys: tuple[ExtraKeys, ...]  # per block: what besides tokens went into its hash
    group_idx: int = 0
    kv_cache_spec_kind: str = FULL_ATTENTION
    kv_cache_spec_sliding_window: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int | bytes, ...]
    medium: str
    group_idx: int = 0


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Forget everything this engine said it holds (a reset, or events were lost)."""


KVCacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventLog:
    """The events of one engine step, in the order the cache produced them. The cache calls
    ``stored`` / ``removed`` / ``cleared`` with its own block hashes; the engine calls ``take``
    once per step and hands the list to the publisher (``kv_events.EventPublisher.publish``)."""

    def __init__(self, hasher: BlockHasher, block_size: int) -> None:
        self.hasher = hasher
        self.block_size = block_size
        self._events: list[KVCacheEvent] = []

    def stored(self, block_hashes: Sequence[BlockHash], parent: BlockHash | None, token_ids: Sequence[int],
               medium: str = MEDIUM_GPU, first_keys: ExtraKeys = None, group_idx: int = 0,
               kv_cache_spec_kind: str = FULL_ATTENTION, sliding_window: int | None = None) -> None:
        """Blocks ``block_hashes`` (a chain after ``parent``) now hold ``token_ids``. ``parent`` None:
        the first of them is the prompt's first block, or (a lower tier's copy, as vLLM's offloading
        events) the parent is not told. ``first_keys``: the extra keys the prompt's first block was
        hashed with (``hashing.first_block_keys``), given when the run starts there; as vLLM, the
        event carries one entry per block, None for a block without extra keys."""
        n = len(block_hashes)
        if n == 0:
            return
        if len(token_ids) != n * self.block_size:
            raise ValueError(f"token_ids: {len(token_ids)} tokens for {n} blocks of {self.block_size}")
        ext = self.hasher.external
        extra_keys = (first_keys if parent is None else None,) + (None,) * (n - 1)
        self._events.append(BlockStored(
            tuple(ext(h) for h in block_hashes), None if parent is None else ext(parent), tuple(token_ids),
            self.block_size, medium, extra_keys, group_idx, kv_cache_spec_kind, sliding_window))

    def removed(self, block_hashes: Sequence[BlockHash], medium: str = MEDIUM_GPU, group_idx: int = 0) -> None:
        if block_hashes:
            self._events.append(BlockRemoved(tuple(self.hasher.external(h) for h in block_hashes), medium,
                                             group_idx))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events
