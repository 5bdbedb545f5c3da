"""Moving whole blocks of K/V between the pool and host buffers, for the KV stores.

A block's payload is its K and V for every layer, as [layers, 2, *block] in the pool's dtype and
layout (model/kv_layout.py: a block of rows [block_size, kv_heads, head_dim], or of a platform's layout),
little-endian as the pool holds it: the layout named by `payload_layout`, which is part of every
stored block's key scope, so a pool of one layout never reads blocks stored from the other.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from prefixserve.model.config import ModelConfig
from prefixserve.model.kv_layout import ROWS, layout_named


def payload_layout(config: ModelConfig, block_size: int, layout: str = ROWS) -> str:
    return layout_named(layout).payload_name(config, block_size)


@torch.inference_mode()
def read_blocks(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> np.ndarray:
    """A copy of the blocks' payloads as uint8 rows, one per block ([n, payload bytes])."""
    idx = torch.tensor(list(block_ids), dtype=torch.long, device=kv_caches[0].device)
    # [L, 2, n, *block] -> [n, L, 2, *block]
    data = torch.stack([cache.index_select(1, idx) for cache in kv_caches]).permute(2, 0, 1, 3, 4, 5)
    data = data.contiguous().cpu()
    return data.view(torch.uint8).reshape(len(block_ids), -1).numpy()


class LoadTargets:
    """Where blocks loaded from a store are read to: each block's payload as writable buffers in
    payload order (one per layer and K/V). On a CPU pool they are the pool's own memory, so a
    store reads straight into it; elsewhere they are a host buffer that `commit` copies into
    the pool."""

    def __init__(self, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int],
                 direct: bool | None = None) -> None:
        self.kv_caches = kv_caches
        self.block_ids = list(block_ids)
        if direct is None:
            direct = all(c.device.type == "cpu" and c.is_contiguous() for c in kv_caches)
        self.direct = direct
        if self.direct:
            self._staging = None
            # Slices of one byte view per layer: a tensor view per block and layer costs
            # more than the read it is for.
            num_blocks = kv_caches[0].shape[1]
            size = kv_caches[0][0, 0].numel() * kv_caches[0].element_size()
            layers = [_bytes_of(cache) for cache in kv_caches]
            self.buffers = [[layer[(kv * num_blocks + b) * size:(kv * num_blocks + b + 1) * size]
                             for layer in layers for kv in (0, 1)] for b in self.block_ids]
        else:
            self._staging = torch.empty((len(self.block_ids), len(kv_caches), 2, *kv_caches[0].shape[2:]),
                                        dtype=kv_caches[0].dtype)
            row = self._staging[0, 0, 0].numel() * self._staging.element_size()
            flat = _bytes_of(self._staging)
            self.buffers = [[flat[(i * 2 * len(kv_caches) + r) * row:
                                  (i * 2 * len(kv_caches) + r + 1) * row]
                             for r in range(2 * len(kv_caches))] for i in range(len(self.block_ids))]

    @torch.inference_mode()
    def commit(self, count: int) -> None:
        """Makes the first `count` blocks' loaded payloads the pool's (a no-op when they were
        read into it directly)."""
        if self._staging is None or count == 0:
            return
        idx = torch.tensor(self.block_ids[:count], dtype=torch.long, device=self.kv_caches[0].device)
        data = self._staging[:count].to(self.kv_caches[0].device)
        for layer, cache in enumerate(self.kv_caches):
            cache.index_copy_(1, idx, data[:, layer].transpose(0, 1))


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's own memory."""
    if not t.is_contiguous():
        raise ValueError("a load target must be contiguous memory")
    return memoryview(t.view(-1).view(torch.uint8).numpy())
