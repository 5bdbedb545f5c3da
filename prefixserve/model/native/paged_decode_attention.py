"""Decode attention over the paged pool without gathering (`paged_decode_attention.c`).

Used by the torch backend's decode path (`model/attention/torch_paged.py`) for float32 and
bfloat16 pools on AVX2 CPUs: the gather-then-attend path reads K/V three times (and widens a
bfloat16 copy), this kernel once, in the pool's own dtype, with float32 math.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from prefixserve.model.native.build import load_default, load_kernel


class PagedDecodeAttention:
    """`__call__(q, kv_cache, tables, lens, scale)` -> (out [B, KVH, R, D], lse [B, KVH, R])."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fn = library.paged_decode_attention
        self._fn.restype = None
        self._fn.argtypes = ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 2
                             + [ctypes.c_long] * 7 + [ctypes.c_float]
                             + [ctypes.c_void_p] * 2 + [ctypes.c_int])

    @staticmethod
    def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        # the call takes float32 queries (a bfloat16 model's are widened first); the pool float32 or bfloat16
        return (q.device.type == "cpu" and q.dtype in (torch.float32, kv_cache.dtype) and kv_cache.device.type == "cpu"
                and kv_cache.dtype in (torch.float32, torch.bfloat16) and kv_cache.is_contiguous()
                and q.shape[-1] % 8 == 0)

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        batch, kv_heads, rows, head_dim = q.shape
        _, num_blocks, block_size, pool_heads, pool_dim = kv_cache.shape
        if (pool_heads, pool_dim) != (kv_heads, head_dim) or tables.shape[0] != batch or lens.shape != (batch,):
            raise ValueError(f"shapes do not match: q {tuple(q.shape)}, pool {tuple(kv_cache.shape)}, "
                             f"tables {tuple(tables.shape)}, lens {tuple(lens.shape)}")
        if tables.dtype != torch.int64 or lens.dtype != torch.int64:
            raise ValueError("tables and lens must be int64")
        if batch and int(lens.max()) > tables.shape[1] * block_size:
            raise ValueError("a length runs past its block table")
        q, tables, lens = q.contiguous(), tables.contiguous(), lens.contiguous()
        out = torch.empty_like(q)
        lse = torch.empty(batch, kv_heads, rows, dtype=torch.float32)
        if q.dtype != torch.float32 or not self.supports(q, kv_cache):
            raise ValueError("needs float32 queries, a contiguous float32 or bfloat16 CPU pool and head_dim % 8 == 0")
        self._fn(q.data_ptr(), kv_cache.data_ptr(), int(kv_cache.dtype == torch.bfloat16), tables.data_ptr(), lens.data_ptr(), batch, kv_heads, rows,
                 head_dim, num_blocks, block_size, tables.shape[1], scale, out.data_ptr(), lse.data_ptr(),
                 torch.get_num_threads())
        return out, lse


def _agrees_with_torch(kernel: PagedDecodeAttention) -> bool:
    """A probe against plain matmuls, on a float32 pool and on the same values held in bfloat16."""
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(2, 5, 4, 2, 16, generator=gen).bfloat16().float()
    q = torch.randn(1, 2, 3, 16, generator=gen)
    tables, lens = torch.tensor([[3, 0, 4]]), torch.tensor([10])
    out, lse = kernel(q, pool, tables, lens, 0.25)
    half_out, half_lse = kernel(q, pool.bfloat16(), tables, lens, 0.25)
    if not (torch.equal(half_out, out) and torch.equal(half_lse, lse)):
        return False
    keys = pool[0][tables[0]].flatten(0, 1)[:10].transpose(0, 1)[None]
    values = pool[1][tables[0]].flatten(0, 1)[:10].transpose(0, 1)[None]
    scores = q @ keys.transpose(-1, -2) * 0.25
    want_lse = scores.logsumexp(-1)
    want_out = (scores - want_lse[..., None]).exp() @ values
    return torch.allclose(out, want_out, atol=1e-5) and torch.allclose(lse, want_lse, atol=1e-5)


def load(cc: str | None, out_dir: Path) -> PagedDecodeAttention | None:
    """Build and load the kernel, checked against plain matmuls on a probe; None where it cannot be used."""
    return load_kernel("paged_decode_attention", cc, out_dir, PagedDecodeAttention, _agrees_with_torch)


@functools.cache
def default_kernel() -> PagedDecodeAttention | None:
    """The process's kernel, built on first use; None where unavailable or turned off."""
    return load_default("paged_decode_attention", PagedDecodeAttention, _agrees_with_torch)
