"""The runner's copy of every live block table, kept across steps (vLLM's ``BlockTable``).

One row of a 2-D int32 array per live sequence. A step applies only what changed: the tables the
scheduler dropped (their rows return to the free list) and, for each scheduled sequence, its
``block_delta`` (first changed index, the ids from there). So the host work per step follows the
new blocks, not the context length: a decode step at 32k tokens copies nothing unless it starts
a block. Entries past a row's length are 0 (the padding the attention kernels expect).
"""

from __future__ import annotations

import numpy as np


class BlockTables:
    def __init__(self, max_blocks_per_seq: int, num_rows: int = 64) -> None:
        self.table = np.zeros((max(num_rows, 1), max(max_blocks_per_seq, 1)), dtype=np.int32)
        self.num_blocks = np.zeros(self.table.shape[0], dtype=np.int64)  # each row's table length
        self.rows: dict[str, int] = {}  # seq_id -> row
        self._free_rows = list(range(self.table.shape[0] - 1, -1, -1))
        self.num_entries_written = 0  # block ids copied in (complexity tests)

    def release(self, seq_ids: list[str]) -> None:
        for sid in seq_ids:
            row = self.rows.pop(sid, None)
            if row is not None:
                self.table[row, :self.num_blocks[row]] = 0
                self.num_blocks[row] = 0
                self._free_rows.append(row)

    def apply(self, seq_id: str, delta: tuple[int, list[int]] | None) -> int:
        """Bring ``seq_id``'s row up to date; returns the row. A sequence seen for the first time
        must come with its whole table (a delta from index 0)."""
        row = self.rows.get(seq_id)
        if row is None:
            assert delta is not None and delta[0] == 0, f"{seq_id}: first seen without its whole table"
            row = self.rows[seq_id] = self._take_row()
        if delta is not None:
            start, ids = delta
            end = start + len(ids)
            if end > self.table.shape[1]:
                self._grow(self.table.shape[0], max(end, 2 * self.table.shape[1]))
            old = self.num_blocks[row]
            if ids:
                self.table[row, start:end] = ids
            if old > end:
                self.table[row, end:old] = 0
            self.num_blocks[row] = end
            self.num_entries_written += len(ids)
        return row

    def gather(self, rows: list[int], num_cols: int) -> np.ndarray:
        """[len(rows), num_cols] int32, contiguous (a copy)."""
        return self.table[np.asarray(rows, dtype=np.int64), :num_cols]

    def _take_row(self) -> int:
        if not self._free_rows:
            n = self.table.shape[0]
            self._grow(2 * n, self.table.shape[1])
            self._free_rows = list(range(2 * n - 1, n - 1, -1))
        return self._free_rows.pop()

    def _grow(self, num_rows: int, num_cols: int) -> None:
        t = np.zeros((num_rows, num_cols), dtype=np.int32)
        r, c = self.table.shape
        t[:r, :c] = self.table
        self.table = t
        nb = np.zeros(num_rows, dtype=np.int64)
        nb[:r] = self.num_blocks
        self.num_blocks = nb
