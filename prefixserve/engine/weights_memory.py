"""Bytes a loaded model holds in memory: its parameters and buffers, each storage once."""
from __future__ import annotations

from itertools import chain

import torch


def weights_bytes(model: torch.nn.Module) -> int:
    """Counted by storage, not by tensor: tied embeddings and views of one fused parameter
    (q/k/v, gate/up) share memory, and the memory is what a serving budget is about."""
    storages: dict[tuple[str, int], int] = {}
    for tensor in chain(model.parameters(), model.buffers()):
        storage = tensor.untyped_storage()
        storages[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())
