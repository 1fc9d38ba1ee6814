"""The runner's mirror of the running sequences' block tables, on the host.

Each scheduled sequence brings the entries of its table that changed since it
was last scheduled (:class:`~kvq.engine.scheduler.ScheduledSeq`), and the
scheduler names the sequences whose blocks were released; a step's
``[B, W]`` table is then one numpy gather of the batch's rows instead of a
rebuild of every table from the block manager.  Entries are signed
(kvq.cache.pool); row tails past a table's length hold 0.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from kvq.cache.pool import encode_table


class BlockTables:
    def __init__(self, rows: int = 64, width: int = 64):
        self.table = np.zeros((rows, width), np.int32)
        self.lens = np.zeros(rows, np.int64)
        self.row_of: dict[int, int] = {}
        self._free = list(range(rows - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.row_of)

    def _grow(self, rows: int, width: int) -> None:
        r, w = self.table.shape
        if rows <= r and width <= w:
            return
        rows, width = max(rows, 2 * r if rows > r else r), max(width, 2 * w if width > w else w)
        table = np.zeros((rows, width), np.int32)
        table[:r, :w] = self.table
        self.table = table
        self.lens = np.concatenate([self.lens, np.zeros(rows - r, np.int64)])
        self._free = list(range(rows - 1, r - 1, -1)) + self._free

    def release(self, seq_ids: Iterable[int]) -> None:
        for sid in seq_ids:
            row = self.row_of.pop(sid, None)
            if row is not None:
                self.table[row, :self.lens[row]] = 0
                self.lens[row] = 0
                self._free.append(row)

    def update(self, seq_id: int, start: int, refs, length: int) -> None:
        """Entries ``[start, length)`` of ``seq_id``'s table are ``refs`` (BlockRefs)."""
        row = self.row_of.get(seq_id)
        if row is None:
            assert start == 0, f"sequence {seq_id}: the first delta must hold the whole table"
            if not self._free:
                self._grow(2 * self.table.shape[0], length)
            row = self.row_of[seq_id] = self._free.pop()
        if length > self.table.shape[1]:
            self._grow(self.table.shape[0], length)
        if refs:
            self.table[row, start:length] = encode_table(refs)
        old = self.lens[row]
        if length < old:
            self.table[row, length:old] = 0
        self.lens[row] = length

    def gather(self, seq_ids: list[int]) -> np.ndarray:
        """``[B, W]`` int32: the tables of ``seq_ids`` in order, W the longest of them."""
        rows = np.fromiter((self.row_of[s] for s in seq_ids), np.int64, len(seq_ids))
        width = int(self.lens[rows].max()) if len(rows) else 0
        return self.table[rows, :width]

    def get(self, seq_id: int) -> list[int]:
        row = self.row_of[seq_id]
        return self.table[row, :self.lens[row]].tolist()
