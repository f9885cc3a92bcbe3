"""The disk tier's index, under the host tier: which pages have a file. No torch, no I/O.

A page the host tier lets go of (its least recently used entry, when a new one needs the slot)
is written to a file keyed by the page's key (kv/keys.py; the worker's ``DiskKVStore`` does the
I/O). The tier keeps at most ``num_blocks`` files, least recently used first out. A prompt whose
device and host hits stop where the disk tier goes on waits until those files are read into memory
(``TierConnector.ready``), then gets fresh device pages copied from them before its step. Files
stay after a read: they are what survives a restart (the worker scans the directory at start and
the connector rebuilds this index from it, ``TierConnector.bind``).
"""

from __future__ import annotations

from collections import OrderedDict

from prefixkv.kv.keys import PageKey


class DiskBlockIndex:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"kv_disk_cache_gb: holds no block (num_blocks={num_blocks})")
        self.num_blocks = num_blocks
        self._entries: OrderedDict[PageKey, tuple[int, ...]] = OrderedDict()  # key -> tokens
        self.num_written = 0
        self.num_read = 0

    @property
    def num_used(self) -> int:
        return len(self._entries)

    def keys(self) -> list[PageKey]:
        return list(self._entries)

    def entries(self) -> list[tuple[PageKey, tuple[int, ...]]]:
        """(key, tokens) of every file, least recently used first."""
        return list(self._entries.items())

    def __contains__(self, key: PageKey) -> bool:
        return key in self._entries

    def add(self, key: PageKey, tokens: tuple[int, ...]) -> list[PageKey]:
        """Record a page the caller writes now; returns the keys whose files go (capacity)."""
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

    def lookup(self, key: PageKey, tokens: tuple[int, ...]) -> bool:
        have = self._entries.get(key)
        if have is None or have != tokens:
            return False
        self._entries.move_to_end(key)
        return True

    def remove(self, key: PageKey) -> None:
        self._entries.pop(key, None)

    def check_integrity(self) -> None:
        assert len(self._entries) <= self.num_blocks, (len(self._entries), self.num_blocks)
