"""Each request's block ids, kept both as a list and as a row of one int32 tensor as they change.

A step's block table is then one gather of the scheduled requests' rows, whatever their length: no
per-step work that grows with the sequences (vLLM's v1 keeps its `BlockTable` the same way). Rows are
zero past each request's length, so the gathered table is zero-padded like one built from lists.
"""

from __future__ import annotations

import torch


class BlockTable:
    def __init__(self, rows: int = 8, cols: int = 16):
        self.table = torch.zeros((rows, cols), dtype=torch.int32)  # int32 [row slots, block capacity]
        self.row_of: dict[str, int] = {}
        self.ids_of: dict[str, list[int]] = {}
        self.free_rows = list(range(rows - 1, -1, -1))

    def ids(self, request_id: str) -> list[int]:
        """The request's block ids in order: the live list, read-only, valid until its blocks change."""
        return self.ids_of.get(request_id, [])

    def append(self, request_id: str, block_ids: list[int]) -> None:
        if not block_ids:
            return
        ids = self.ids_of.setdefault(request_id, [])
        row = self.row_of.get(request_id)
        if row is None:
            row = self.row_of[request_id] = self._take_row()
        start, end = len(ids), len(ids) + len(block_ids)
        if end > self.table.shape[1]:
            self._grow(self.table.shape[0], max(end, 2 * self.table.shape[1]))
        self.table[row, start:end] = torch.tensor(block_ids, dtype=torch.int32)
        ids.extend(block_ids)

    def pop(self, request_id: str) -> int:
        """Remove and return the request's last block id."""
        ids = self.ids_of[request_id]
        self.table[self.row_of[request_id], len(ids) - 1] = 0
        return ids.pop()

    def release(self, request_id: str) -> None:
        ids = self.ids_of.pop(request_id, [])
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.table[row, :len(ids)] = 0
            self.free_rows.append(row)

    def gather(self, request_ids: list[str]) -> torch.Tensor:
        """int32 [len(request_ids), longest], zero-padded: the rows of the given requests (each must hold blocks)."""
        width = max(len(self.ids_of[r]) for r in request_ids)
        rows = torch.tensor([self.row_of[r] for r in request_ids], dtype=torch.int64)
        return self.table[:, :width].index_select(0, rows)

    def _take_row(self) -> int:
        if not self.free_rows:
            rows = self.table.shape[0]
            self._grow(2 * rows, self.table.shape[1])
            self.free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self.free_rows.pop()

    def _grow(self, rows: int, cols: int) -> None:
        table = torch.zeros((rows, cols), dtype=torch.int32)
        table[:self.table.shape[0], :self.table.shape[1]] = self.table
        self.table = table
