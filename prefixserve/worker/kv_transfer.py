"""Moving whole blocks of K/V between the pool and host buffers, for the KV stores.

A block's payload is its K and V for every layer, as [layers, 2, block_size, kv_heads,
head_dim] in the pool's dtype, little-endian as the pool holds it: the layout named by
`payload_layout`, which is part of every stored block's key scope.
"""
from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np
import torch

from prefixserve.model.config import ModelConfig


def payload_layout(config: ModelConfig, block_size: int) -> str:
    return (f"L{config.num_hidden_layers}x[K,V]x{block_size}x{config.num_key_value_heads}"
            f"x{config.head_dim}/pool-v1")


@torch.inference_mode()
def read_blocks(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> np.ndarray:
    """A copy of the blocks' payloads as uint8 rows, one per block ([n, payload bytes])."""
    idx = torch.tensor(list(block_ids), dtype=torch.long, device=kv_caches[0].device)
    # [L, 2, n, bs, H, D] -> [n, L, 2, bs, H, D]
    data = torch.stack([cache.index_select(1, idx) for cache in kv_caches]).permute(2, 0, 1, 3, 4, 5)
    data = data.contiguous().cpu()
    return data.view(torch.uint8).reshape(len(block_ids), -1).numpy()


@torch.inference_mode()
def write_blocks(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int],
                 payloads: Sequence) -> None:
    """Writes payloads (buffers of the layout above, already verified) into the blocks: one
    copy per block and layer straight from the buffer, nothing staged."""
    if not block_ids:
        return
    first = kv_caches[0]
    _, _, bs, heads, dim = first.shape
    shape = (len(kv_caches), 2, bs, heads, dim)
    for block_id, payload in zip(block_ids, payloads):
        with warnings.catch_warnings():
            # Read-only buffers (bytes): the tensor is only read from, never written.
            warnings.simplefilter("ignore", UserWarning)
            data = torch.frombuffer(payload, dtype=torch.uint8)
        data = data.view(first.dtype).view(shape).to(first.device)
        for layer, cache in enumerate(kv_caches):
            cache[:, block_id].copy_(data[layer])
