"""Shape, size and layout of the paged KV pool that the attention backends read and write.

Per layer, one tensor whose index 0 holds K and index 1 holds V. Slot s of a pool
is token offset s % block_size of block s // block_size. Two layouts:

- "rows" [2, num_blocks, block_size, num_kv_heads, head_dim]: a token's K (V) row
  for every head, token after token. Any dtype, any block size; every backend reads it.
- "panels" [2, num_blocks, num_kv_heads, block_size, head_dim] (bfloat16 or float32,
  block sizes and head dims of whole 16-element panels): one head's keys of a block
  are one run of memory, already in the form the native kernels' tiles multiply.
  Within (block, head), K is block_size / 16 panels of [head_dim / w][16] 32-bit
  words and V block_size / w rows of head_dim words, w the elements a word holds.
  bfloat16 (w = 2): K word (i, j) holds dims 2i (low half) and 2i + 1 of key j; V
  word (p, c) holds column c of keys 2p (low half) and 2p + 1. float32 (w = 1): K
  panels are [head_dim][16] (a transposed panel of keys), V rows are the keys' rows.
  The tiles read a panel where it lies instead of transposing rows into one
  (`native/attention_tiles.h`); the tensor's shape names only the (block, head)
  runs, not the words within them.

A block's bytes mean different things in the two layouts, so everything that
stores blocks outside the pool keys them by layout (kv/stores/scope.py).
"""
from __future__ import annotations

import torch

from prefixserve.model.config import ModelConfig

ROWS, PANELS = "rows", "panels"
LAYOUTS = (ROWS, PANELS)
# the layout argument of the native attention and pointwise kernels
LAYOUT_CODES = {ROWS: 0, PANELS: 1}
PANEL_KEYS = 16


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown KV layout {layout!r}; one of {LAYOUTS}")


PANEL_DTYPES = (torch.bfloat16, torch.float32)


def panels_fit(dtype: torch.dtype, block_size: int, head_dim: int) -> bool:
    """Whether a pool of this dtype, block size and head dim can be laid out in panels."""
    return dtype in PANEL_DTYPES and block_size % PANEL_KEYS == 0 and head_dim % PANEL_KEYS == 0


def kv_cache_shape(config: ModelConfig, num_blocks: int, block_size: int, layout: str = ROWS) -> tuple[int, ...]:
    """Shape of one layer's pool tensor."""
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    check_layout(layout)
    if layout == PANELS:
        return (2, num_blocks, config.num_key_value_heads, block_size, config.head_dim)
    return (2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)


def pool_geometry(kv_cache: torch.Tensor, layout: str) -> tuple[int, int, int, int]:
    """(num_blocks, block_size, num_kv_heads, head_dim) of one layer's pool in `layout`."""
    check_layout(layout)
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"a pool is [2, ...] of 5 dims, got {tuple(kv_cache.shape)}")
    if layout == PANELS:
        _, num_blocks, kv_heads, block_size, head_dim = kv_cache.shape
        if not panels_fit(kv_cache.dtype, block_size, head_dim):
            raise ValueError(f"a {kv_cache.dtype} pool of blocks of {block_size} and head dim {head_dim} "
                             "cannot hold panels")
    else:
        _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    return num_blocks, block_size, kv_heads, head_dim


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block occupies across every layer's K and V (either layout)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.kv_size * element


def _word(dtype: torch.dtype) -> int:
    """Elements of a panel's 32-bit word: 2 bfloat16, 1 float32."""
    return 4 // torch.empty((), dtype=dtype).element_size()


def _panel_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool of panels as K [NB, KVH, BS/16, D/w, 16, w] and V [NB, KVH, BS/w, D, w] (views; w = _word)."""
    _, nb, kvh, bs, d = kv_cache.shape
    w = _word(kv_cache.dtype)
    return (kv_cache[0].view(nb, kvh, bs // PANEL_KEYS, d // w, PANEL_KEYS, w),
            kv_cache[1].view(nb, kvh, bs // w, d, w))


def write_kv(kv_cache: torch.Tensor, layout: str, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Tokens' K and V [T, KVH, D] into their slots [T] (int64) of one layer's pool."""
    num_blocks, block_size, kv_heads, head_dim = pool_geometry(kv_cache, layout)
    if layout == ROWS:
        kv_cache[0].view(-1, kv_heads, head_dim).index_copy_(0, slots, k)
        kv_cache[1].view(-1, kv_heads, head_dim).index_copy_(0, slots, v)
        return
    keys, values = _panel_views(kv_cache)
    w = _word(kv_cache.dtype)
    block, offset = slots // block_size, slots % block_size
    keys[block, :, offset // PANEL_KEYS, :, offset % PANEL_KEYS, :] = k.reshape(-1, kv_heads, head_dim // w, w)
    values[block, :, offset // w, :, offset % w] = v.reshape(-1, kv_heads, head_dim)


def gather_rows(kv_cache: torch.Tensor, layout: str, blocks: torch.Tensor,
                keys: torch.Tensor, values: torch.Tensor) -> None:
    """K and V of `blocks` as token rows into keys and values [len(blocks), block_size, KVH, D]."""
    if layout == ROWS:
        pool_geometry(kv_cache, layout)
        torch.index_select(kv_cache[0], 0, blocks, out=keys)
        torch.index_select(kv_cache[1], 0, blocks, out=values)
        return
    _, block_size, kv_heads, head_dim = pool_geometry(kv_cache, layout)
    k_panels, v_words = _panel_views(kv_cache)
    n, w = blocks.numel(), _word(kv_cache.dtype)
    # [n, KVH, BS/16, D/w, 16, w] -> [n, BS/16, 16, KVH, D/w, w]
    keys.view(n, block_size // PANEL_KEYS, PANEL_KEYS, kv_heads, head_dim // w, w).copy_(
        k_panels.index_select(0, blocks).permute(0, 2, 4, 1, 3, 5))
    # [n, KVH, BS/w, D, w] -> [n, BS/w, w, KVH, D]
    values.view(n, block_size // w, w, kv_heads, head_dim).copy_(v_words.index_select(0, blocks).permute(0, 2, 4, 1, 3))


def to_layout(rows: torch.Tensor, layout: str) -> torch.Tensor:
    """A pool of rows [2, NB, BS, KVH, D] laid out in `layout` (a new tensor for panels)."""
    check_layout(layout)
    if layout == ROWS:
        return rows
    _, nb, bs, kvh, d = rows.shape
    out = torch.empty((2, nb, kvh, bs, d), dtype=rows.dtype, device=rows.device)
    pool_geometry(out, PANELS)
    write_kv(out, PANELS, torch.arange(nb * bs, device=rows.device), rows[0].reshape(-1, kvh, d),
             rows[1].reshape(-1, kvh, d))
    return out
