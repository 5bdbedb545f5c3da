"""The worker's copy of every running request's block table, kept between steps.

The scheduler sends a request's whole table once (and again only after a
copy-on-write swapped one of its blocks), then just the blocks appended each
step (see scheduler/output.py). Rows live in one host int64 array, grown in
place, so a step's padded block tables are one array gather instead of a
rebuild from Python lists.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


class BlockTables:
    """One row per request: entries [0, lengths[row]) are its physical block ids, the rest 0
    (the padding attention kernels expect). Rows and columns double when outgrown."""

    def __init__(self, rows: int = 64, columns: int = 64) -> None:
        self.array = np.zeros((rows, columns), dtype=np.int64)
        self.lengths = np.zeros(rows, dtype=np.int64)
        self._rows: dict[str, int] = {}
        self._free = list(range(rows - 1, -1, -1))
        # (row, first column, end column) of every write since the last `take_changes`, kept only once a
        # device copy updated by deltas asks for them (device_block_tables.py)
        self.changes: list[tuple[int, int, int]] | None = None
        self.reshaped = False

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._rows

    def request_ids(self) -> list[str]:
        return list(self._rows)

    def row(self, request_id: str) -> int:
        row = self._rows.get(request_id)
        if row is None:
            raise KeyError(f"the worker holds no block table for request {request_id!r}")
        return row

    def table(self, request_id: str) -> list[int]:
        row = self.row(request_id)
        return self.array[row, :self.lengths[row]].tolist()

    def write(self, request_id: str, block_ids: Sequence[int]) -> int:
        """Sets the request's whole table (a new row if it has none); returns its row."""
        row = self._rows.get(request_id)
        if row is None:
            row = self._rows[request_id] = self._take_row()
        n, old = len(block_ids), int(self.lengths[row])
        self._fit_columns(n)
        self.array[row, :n] = block_ids
        if old > n:
            self.array[row, n:old] = 0
        self.lengths[row] = n
        self._changed(row, 0, max(n, old))
        return row

    def append(self, request_id: str, block_ids: Sequence[int]) -> int:
        """Appends blocks to the request's table; returns its row."""
        row = self.row(request_id)
        start = int(self.lengths[row])
        end = start + len(block_ids)
        self._fit_columns(end)
        self.array[row, start:end] = block_ids
        self.lengths[row] = end
        self._changed(row, start, end)
        return row

    def drop(self, request_id: str) -> None:
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._changed(row, 0, int(self.lengths[row]))
            self.array[row, :self.lengths[row]] = 0
            self.lengths[row] = 0
            self._free.append(row)

    def take_changes(self) -> tuple[list[tuple[int, int, int]], bool]:
        """The writes since the last call and whether the array was reallocated meanwhile; forgets them.
        The first call starts the record."""
        changes, reshaped = self.changes or [], self.reshaped
        self.changes, self.reshaped = [], False
        return changes, reshaped

    def _changed(self, row: int, start: int, end: int) -> None:
        if self.changes is not None:
            self.changes.append((row, start, end))

    def _take_row(self) -> int:
        if not self._free:
            rows, columns = self.array.shape
            self.array = np.concatenate([self.array, np.zeros((rows, columns), dtype=np.int64)])
            self.lengths = np.concatenate([self.lengths, np.zeros(rows, dtype=np.int64)])
            self.reshaped = True
            self._free = list(range(2 * rows - 1, rows - 1, -1))
        return self._free.pop()

    def _fit_columns(self, needed: int) -> None:
        rows, columns = self.array.shape
        if needed > columns:
            wider = np.zeros((rows, max(needed, 2 * columns)), dtype=np.int64)
            wider[:, :columns] = self.array
            self.array = wider
            self.reshaped = True
