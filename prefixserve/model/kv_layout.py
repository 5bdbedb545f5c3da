"""Shape and size of the paged KV pool that the attention backends read and write.

Per layer, one tensor [2, num_blocks, block_size, num_kv_heads, head_dim]:
index 0 holds K, index 1 holds V. Slot s of the flattened [num_blocks *
block_size] axis is token offset s % block_size of block s // block_size.
"""
from __future__ import annotations

import torch

from prefixserve.model.config import ModelConfig


def kv_cache_shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """Shape of one layer's pool tensor."""
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return (2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block occupies across every layer's K and V."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.kv_size * element
