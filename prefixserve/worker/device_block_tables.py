"""The worker's block tables (block_tables.py) kept on the device, updated by deltas.

A running request's table changes by a block every block_size tokens, so re-sending every table each
step moves hundreds of unchanged ids per sequence to the device. Here the device holds a copy of the whole
host array; each step sends only the cells written since the last step (one index and one value array,
one scatter), or the whole array after it was reallocated, and a step's tables are one gather on the device
by the rows of its sequences.
"""
from __future__ import annotations

import numpy as np
import torch

from prefixserve.worker.block_tables import BlockTables


class DeviceBlockTables:
    def __init__(self, host: BlockTables, device: torch.device | str) -> None:
        self.host = host
        self.device = torch.device(device)
        self.tensor = torch.from_numpy(host.array.copy()).to(self.device)
        host.take_changes()
        # cells sent by the last sync (a full upload counts every cell): what the deltas save is visible
        self.last_sent = 0

    def sync(self) -> None:
        """Brings the device copy up to the host array."""
        changes, reshaped = self.host.take_changes()
        array = self.host.array
        if reshaped or self.tensor.shape != array.shape:
            self.tensor = torch.from_numpy(array.copy()).to(self.device)
            self.last_sent = array.size
            return
        spans = [(row, start, end) for row, start, end in changes if end > start]
        if not spans:
            self.last_sent = 0
            return
        columns = array.shape[1]
        flat = np.concatenate([row * columns + np.arange(start, end, dtype=np.int64) for row, start, end in spans])
        flat = np.unique(flat)
        values = array.reshape(-1)[flat]
        self.tensor.view(-1).index_copy_(0, torch.from_numpy(flat).to(self.device),
                                         torch.from_numpy(values).to(self.device))
        self.last_sent = len(flat)

    def gather(self, rows: np.ndarray, width: int) -> torch.Tensor:
        """The tables of `rows` (host row indices), `width` columns, as one device tensor."""
        return self.tensor.index_select(0, torch.from_numpy(rows).to(self.device))[:, :width]
