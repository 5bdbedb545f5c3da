"""Decode attention over the paged pool without gathering (`paged_decode_attention.c`).

Used by the torch backend's decode path (`model/attention/torch_paged.py`) for float32 and
bfloat16 pools on AVX2 CPUs: the gather-then-attend path reads K/V three times (and widens a
bfloat16 copy), this kernel once, in the pool's own dtype, with float32 math.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from prefixserve.model.native.build import load_default, load_kernel


@dataclass
class DecodeState:
    """Where an online softmax over a context's leading blocks left off, per query row: the unnormalised
    output `acc` [B, KVH, R, D], the running max `m` and denominator `l` [B, KVH, R], all float32.
    A later call carries on from it over the following blocks exactly as one pass over all of them
    would (the same operations in the same order), which a merge of two finished halves does not."""
    acc: torch.Tensor
    m: torch.Tensor
    l: torch.Tensor


class PagedDecodeAttention:
    """`__call__(q, kv_cache, tables, lens, scale)` -> (out [B, KVH, R, D], lse [B, KVH, R]);
    `partial(...)` -> the DecodeState a later `__call__(..., carry=state)` finishes."""

    def __init__(self, library: ctypes.CDLL, avx512: bool | None = None) -> None:
        self._fn = library.paged_decode_attention
        self._fn.restype = None
        self._fn.argtypes = ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 2
                             + [ctypes.c_long] * 7 + [ctypes.c_float]
                             + [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4)
        self._library = library
        # the AVX-512 body, where the CPU runs it (torch asks the CPU and the OS)
        self.avx512 = torch.backends.cpu.get_cpu_capability() == "AVX512" if avx512 is None else avx512

    def with_avx512(self, avx512: bool) -> "PagedDecodeAttention":
        """The same library through the other body (tests compare them; the caller checks the CPU)."""
        return PagedDecodeAttention(self._library, avx512)

    @staticmethod
    def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        # the call takes float32 queries (a bfloat16 model's are widened first); the pool float32 or bfloat16
        return (q.device.type == "cpu" and q.dtype in (torch.float32, kv_cache.dtype) and kv_cache.device.type == "cpu"
                and kv_cache.dtype in (torch.float32, torch.bfloat16) and kv_cache.is_contiguous()
                and q.shape[-1] % 8 == 0)

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                 scale: float, carry: DecodeState | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Finished attention over the blocks of `tables` (after `carry`'s, when given: its acc is
        finished in place and returned as out)."""
        state, lse = self._run(q, kv_cache, tables, lens, scale, carry, finalize=True)
        return state.acc, lse

    def partial(self, q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                scale: float) -> DecodeState:
        """The online softmax over the blocks of `tables`, left unfinished for a later call to carry on."""
        return self._run(q, kv_cache, tables, lens, scale, None, finalize=False)[0]

    def _run(self, q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, scale: float,
             carry: DecodeState | None, finalize: bool) -> tuple[DecodeState, torch.Tensor]:
        batch, kv_heads, rows, head_dim = q.shape
        _, num_blocks, block_size, pool_heads, pool_dim = kv_cache.shape
        if (pool_heads, pool_dim) != (kv_heads, head_dim) or tables.shape[0] != batch or lens.shape != (batch,):
            raise ValueError(f"shapes do not match: q {tuple(q.shape)}, pool {tuple(kv_cache.shape)}, "
                             f"tables {tuple(tables.shape)}, lens {tuple(lens.shape)}")
        if tables.dtype != torch.int64 or lens.dtype != torch.int64:
            raise ValueError("tables and lens must be int64")
        if batch and int(lens.max()) > tables.shape[1] * block_size:
            raise ValueError("a length runs past its block table")
        if q.dtype != torch.float32 or not self.supports(q, kv_cache):
            raise ValueError("needs float32 queries, a contiguous float32 or bfloat16 CPU pool and head_dim % 8 == 0")
        q, tables, lens = q.contiguous(), tables.contiguous(), lens.contiguous()
        if carry is not None:
            acc, m, l = carry.acc, carry.m, carry.l
            if (acc.shape != q.shape or m.shape != q.shape[:3] or l.shape != m.shape or not acc.is_contiguous()
                    or not m.is_contiguous() or not l.is_contiguous()
                    or {acc.dtype, m.dtype, l.dtype} != {torch.float32}):
                raise ValueError("carry must hold contiguous float32 acc [B, KVH, R, D], m and l [B, KVH, R] "
                                 "matching q")
        else:
            acc = torch.empty_like(q)
            m = torch.empty(batch, kv_heads, rows, dtype=torch.float32)
            l = torch.empty_like(m)
        lse = torch.empty(batch, kv_heads, rows, dtype=torch.float32)
        self._fn(q.data_ptr(), kv_cache.data_ptr(), int(kv_cache.dtype == torch.bfloat16), tables.data_ptr(),
                 lens.data_ptr(), batch, kv_heads, rows, head_dim, num_blocks, block_size, tables.shape[1], scale,
                 acc.data_ptr(), lse.data_ptr(), m.data_ptr(), l.data_ptr(), int(carry is not None), int(finalize),
                 int(self.avx512 and head_dim % 16 == 0), torch.get_num_threads())
        return DecodeState(acc, m, l), lse


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
