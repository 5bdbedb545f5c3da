"""The CPU kernels' KV layout, "panels": a pool the native attention tiles read where it lies.

"panels" [2, num_blocks, num_kv_heads, block_size, head_dim] (bfloat16 or float32,
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

Its blocks are stored outside the pool under their own payload name ("panels-v1"),
so a pool of rows never reads them (model/kv_layout.py).
"""
from __future__ import annotations

import torch

from prefixserve.model.config import ModelConfig
from prefixserve.model.kv_layout import ROWS, KVLayout, pool_geometry, register_layout

PANELS = "panels"
# the layout argument of the native attention and pointwise kernels
LAYOUT_CODES = {ROWS: 0, PANELS: 1}
PANEL_KEYS = 16
PANEL_DTYPES = (torch.bfloat16, torch.float32)


def panels_fit(dtype: torch.dtype, block_size: int, head_dim: int) -> bool:
    """Whether a pool of this dtype, block size and head dim can be laid out in panels."""
    return dtype in PANEL_DTYPES and block_size % PANEL_KEYS == 0 and head_dim % PANEL_KEYS == 0


def _word(dtype: torch.dtype) -> int:
    """Elements of a panel's 32-bit word: 2 bfloat16, 1 float32."""
    return 4 // torch.empty((), dtype=dtype).element_size()


def _panel_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool of panels as K [NB, KVH, BS/16, D/w, 16, w] and V [NB, KVH, BS/w, D, w] (views; w = _word)."""
    _, nb, kvh, bs, d = kv_cache.shape
    w = _word(kv_cache.dtype)
    return (kv_cache[0].view(nb, kvh, bs // PANEL_KEYS, d // w, PANEL_KEYS, w),
            kv_cache[1].view(nb, kvh, bs // w, d, w))


class PanelsLayout(KVLayout):
    name = PANELS

    def fits(self, dtype: torch.dtype, block_size: int, head_dim: int) -> bool:
        return panels_fit(dtype, block_size, head_dim)

    def pool_shape(self, num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, kv_heads, block_size, head_dim)

    def geometry(self, kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
        _, num_blocks, kv_heads, block_size, head_dim = kv_cache.shape
        if not panels_fit(kv_cache.dtype, block_size, head_dim):
            raise ValueError(f"a {kv_cache.dtype} pool of blocks of {block_size} and head dim {head_dim} "
                             "cannot hold panels")
        return num_blocks, block_size, kv_heads, head_dim

    def write(self, kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        _, block_size, kv_heads, head_dim = pool_geometry(kv_cache, PANELS)
        keys, values = _panel_views(kv_cache)
        w = _word(kv_cache.dtype)
        block, offset = slots // block_size, slots % block_size
        keys[block, :, offset // PANEL_KEYS, :, offset % PANEL_KEYS, :] = k.reshape(-1, kv_heads, head_dim // w, w)
        values[block, :, offset // w, :, offset % w] = v.reshape(-1, kv_heads, head_dim)

    def gather_rows(self, kv_cache: torch.Tensor, blocks: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor) -> None:
        _, block_size, kv_heads, head_dim = pool_geometry(kv_cache, PANELS)
        k_panels, v_words = _panel_views(kv_cache)
        n, w = blocks.numel(), _word(kv_cache.dtype)
        # [n, KVH, BS/16, D/w, 16, w] -> [n, BS/16, 16, KVH, D/w, w]
        keys.view(n, block_size // PANEL_KEYS, PANEL_KEYS, kv_heads, head_dim // w, w).copy_(
            k_panels.index_select(0, blocks).permute(0, 2, 4, 1, 3, 5))
        # [n, KVH, BS/w, D, w] -> [n, BS/w, w, KVH, D]
        values.view(n, block_size // w, w, kv_heads, head_dim).copy_(
            v_words.index_select(0, blocks).permute(0, 2, 4, 1, 3))

    def from_rows(self, rows: torch.Tensor) -> torch.Tensor:
        _, nb, bs, kvh, d = rows.shape
        out = torch.empty((2, nb, kvh, bs, d), dtype=rows.dtype, device=rows.device)
        pool_geometry(out, PANELS)
        self.write(out, torch.arange(nb * bs, device=rows.device), rows[0].reshape(-1, kvh, d),
                   rows[1].reshape(-1, kvh, d))
        return out

    def payload_name(self, config: ModelConfig, block_size: int) -> str:
        return (f"L{config.num_hidden_layers}x[K,V]x{config.num_key_value_heads}x{block_size}"
                f"x{config.head_dim}/panels-v1")


register_layout(PanelsLayout())
