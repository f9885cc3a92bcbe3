"""A fixed pool of KV blocks: ids, reference counts, free list, evictable count. No torch.

A block is in exactly one of three states::

    free       ref_cnt == 0                    on the free list, content meaningless
    evictable  ref_cnt == 1 and cached         held only by a cache; reclaimable
    in use     otherwise                       held by at least one request's block table

``cached`` means a cache over the pool holds the block (the radix index, or a sliding-window
group's cache: kv/managers.py) and counts as one of its holders. ``clock`` is the LRU time those
caches stamp their entries with: one tick per lookup or insert that touches, so that eviction can
take the oldest entry of all of them.
"""

from __future__ import annotations

from array import array
from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        # per-block arrays, not lists: a full garbage collection walks every element of a list
        # (10^6 blocks: ~2 million visits per collection for these two alone)
        self.ref_cnt = array("i", bytes(4 * num_blocks))
        self.cached = bytearray(num_blocks)  # 1 while a cache holds the block
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.num_evictable = 0
        self.clock = 0

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - self.num_free - self.num_evictable

    def allocate(self) -> int:
        """Take a free block (ref_cnt becomes 1). The caller evicts first if none is free."""
        if not self.free_ids:
            raise RuntimeError("BlockPool.allocate: no free block (evict first)")
        block_id = self.free_ids.popleft()
        self.ref_cnt[block_id] = 1
        return block_id

    def incref(self, block_id: int) -> None:
        rc = self.ref_cnt[block_id]
        assert rc >= 1, f"incref of free block {block_id}"
        if rc == 1 and self.cached[block_id]:
            self.num_evictable -= 1
        self.ref_cnt[block_id] = rc + 1

    def decref(self, block_id: int) -> None:
        rc = self.ref_cnt[block_id] - 1
        assert rc >= 0, f"decref of free block {block_id}"
        self.ref_cnt[block_id] = rc
        if rc == 0:
            assert not self.cached[block_id], f"block {block_id} reached ref 0 while cached"
            self.free_ids.append(block_id)
        elif rc == 1 and self.cached[block_id]:
            self.num_evictable += 1

    def pin(self, block_id: int) -> None:
        """A cache takes hold of a block a request holds."""
        assert not self.cached[block_id] and self.ref_cnt[block_id] >= 1, (
            f"pin of block {block_id}: ref_cnt={self.ref_cnt[block_id]} cached={self.cached[block_id]}")
        self.cached[block_id] = 1
        self.ref_cnt[block_id] += 1

    def unpin(self, block_id: int) -> None:
        """A cache lets go of an evictable block; it becomes free."""
        assert self.cached[block_id] and self.ref_cnt[block_id] == 1, (
            f"unpin of block {block_id}: ref_cnt={self.ref_cnt[block_id]} cached={self.cached[block_id]}")
        self.cached[block_id] = 0
        self.num_evictable -= 1
        self.ref_cnt[block_id] = 0
        self.free_ids.append(block_id)

    def check_integrity(self) -> None:
        free = set(self.free_ids)
        assert len(free) == len(self.free_ids), f"duplicate ids on the free list: {list(self.free_ids)}"
        zero = {b for b, rc in enumerate(self.ref_cnt) if rc == 0}
        assert free == zero, f"free list {sorted(free)} != blocks with ref 0 {sorted(zero)}"
        evictable = sum(1 for b, rc in enumerate(self.ref_cnt) if rc == 1 and self.cached[b])
        assert evictable == self.num_evictable, f"num_evictable={self.num_evictable}, counted {evictable}"
        assert all(rc >= 0 for rc in self.ref_cnt)
        assert self.num_free + self.num_evictable + self.num_in_use == self.num_blocks
