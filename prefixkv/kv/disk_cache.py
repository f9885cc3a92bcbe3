"""The disk tier's index, under the host tier: which blocks have a file. No torch, no I/O.

A block the host tier lets go of (its least recently used entry, when a new one needs the slot)
is written to a file keyed by its chain hash (the runner's ``DiskKVStore`` does the I/O). The tier
keeps at most ``num_blocks`` files, least recently used first out. A prompt whose device and host
matches stop where the disk tier goes on waits until those files are read into memory (the
scheduler's ``disk_prefetch``), then gets fresh device blocks copied from them before its step.
Files stay after a read: they are what survives a restart (the engine rebuilds this
index from the directory at start, ``DiskKVStore.scan``).
"""

from __future__ import annotations

from collections import OrderedDict


class DiskBlockIndex:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"kv_disk_cache_gb: holds no block (num_blocks={num_blocks})")
        self.num_blocks = num_blocks
        self._entries: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # hash -> tokens
        self.num_written = 0
        self.num_read = 0

    @property
    def num_used(self) -> int:
        return len(self._entries)

    def keys(self) -> list[int]:
        return list(self._entries)

    def __contains__(self, key: int) -> bool:
        return key in self._entries

    def add(self, key: int, tokens: tuple[int, ...]) -> list[int]:
        """Record a block the caller writes now; returns the keys whose files go (capacity)."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return []
        self._entries[key] = tokens
        self.num_written += 1
        dropped = []
        while len(self._entries) > self.num_blocks:
            k, _ = self._entries.popitem(last=False)
            dropped.append(k)
        return dropped

    def lookup(self, key: int, tokens: tuple[int, ...]) -> bool:
        have = self._entries.get(key)
        if have is None or have != tokens:
            return False
        self._entries.move_to_end(key)
        return True

    def remove(self, key: int) -> None:
        self._entries.pop(key, None)

    def check_integrity(self) -> None:
        assert len(self._entries) <= self.num_blocks, (len(self._entries), self.num_blocks)
