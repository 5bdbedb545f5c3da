"""Shape, size and layout of the paged KV pool that the attention backends read and write.

Per layer, one tensor whose index 0 holds K and index 1 holds V. Slot s of a pool
is token offset s % block_size of block s // block_size. The layout every device
has is "rows" [2, num_blocks, block_size, num_kv_heads, head_dim]: a token's K (V)
row for every head, token after token. Any dtype, any block size; every backend
reads it. A platform may register layouts of its own kernels (`register_layout`;
the CPU platform's "panels", platforms/cpu/panels.py); a layout is known by its
name everywhere above the platform (the engine's `kv_layout`, the attention
metadata, /health).

A block's bytes mean different things in two layouts, so everything that stores
blocks outside the pool keys them by the layout's `payload_name`
(kv/stores/scope.py).
"""
from __future__ import annotations

import torch

from prefixserve.model.config import ModelConfig

ROWS = "rows"


class KVLayout:
    """How one layer's pool holds K/V; this base is "rows". A platform's layout overrides every method."""
    name = ROWS

    def fits(self, dtype: torch.dtype, block_size: int, head_dim: int) -> bool:
        """Whether a pool of this dtype, block size and head dim can be laid out so."""
        return True

    def pool_shape(self, num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, kv_heads, head_dim)

    def geometry(self, kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
        """(num_blocks, block_size, num_kv_heads, head_dim) of a 5-dim pool [2, ...] in this layout."""
        _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
        return num_blocks, block_size, kv_heads, head_dim

    def write(self, kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Tokens' K and V [T, KVH, D] into their slots [T] (int64) of one layer's pool."""
        _, _, kv_heads, head_dim = pool_geometry(kv_cache, self.name)
        kv_cache[0].view(-1, kv_heads, head_dim).index_copy_(0, slots, k)
        kv_cache[1].view(-1, kv_heads, head_dim).index_copy_(0, slots, v)

    def gather_rows(self, kv_cache: torch.Tensor, blocks: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor) -> None:
        """K and V of `blocks` as token rows into keys and values [len(blocks), block_size, KVH, D]."""
        pool_geometry(kv_cache, self.name)
        torch.index_select(kv_cache[0], 0, blocks, out=keys)
        torch.index_select(kv_cache[1], 0, blocks, out=values)

    def from_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """A pool of rows [2, NB, BS, KVH, D] laid out so (the pool itself for rows)."""
        return rows

    def payload_name(self, config: ModelConfig, block_size: int) -> str:
        """The name a stored block's payload carries in its key scope (part of every KV-store key)."""
        return (f"L{config.num_hidden_layers}x[K,V]x{block_size}x{config.num_key_value_heads}"
                f"x{config.head_dim}/pool-v1")


# name -> layout; "rows" here, the others registered by their platforms
_LAYOUTS: dict[str, KVLayout] = {ROWS: KVLayout()}


def register_layout(layout: KVLayout) -> KVLayout:
    """Makes `layout` known by its name (a platform's, at import)."""
    known = _LAYOUTS.get(layout.name)
    if known is not None and type(known) is not type(layout):
        raise ValueError(f"KV layout {layout.name!r} is registered twice")
    _LAYOUTS[layout.name] = layout
    return layout


def layout_named(name: str) -> KVLayout:
    """The layout called `name`; the platforms are loaded first where it is not known yet."""
    layout = _LAYOUTS.get(name)
    if layout is None:
        from prefixserve.model.platform import load_platforms
        load_platforms()
        layout = _LAYOUTS.get(name)
    if layout is None:
        raise ValueError(f"unknown KV layout {name!r}; one of {tuple(_LAYOUTS)}")
    return layout


def check_layout(layout: str) -> None:
    layout_named(layout)


def kv_cache_shape(config: ModelConfig, num_blocks: int, block_size: int, layout: str = ROWS) -> tuple[int, ...]:
    """Shape of one layer's pool tensor."""
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return layout_named(layout).pool_shape(num_blocks, block_size, config.num_key_value_heads, config.head_dim)


def pool_geometry(kv_cache: torch.Tensor, layout: str) -> tuple[int, int, int, int]:
    """(num_blocks, block_size, num_kv_heads, head_dim) of one layer's pool in `layout`."""
    kind = layout_named(layout)
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"a pool is [2, ...] of 5 dims, got {tuple(kv_cache.shape)}")
    return kind.geometry(kv_cache)


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block occupies across every layer's K and V (any layout)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.kv_size * element


def write_kv(kv_cache: torch.Tensor, layout: str, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Tokens' K and V [T, KVH, D] into their slots [T] (int64) of one layer's pool."""
    layout_named(layout).write(kv_cache, slots, k, v)


def gather_rows(kv_cache: torch.Tensor, layout: str, blocks: torch.Tensor,
                keys: torch.Tensor, values: torch.Tensor) -> None:
    """K and V of `blocks` as token rows into keys and values [len(blocks), block_size, KVH, D]."""
    layout_named(layout).gather_rows(kv_cache, blocks, keys, values)


def to_layout(rows: torch.Tensor, layout: str) -> torch.Tensor:
    """A pool of rows [2, NB, BS, KVH, D] laid out in `layout` (a new tensor where that is not rows)."""
    return layout_named(layout).from_rows(rows)
