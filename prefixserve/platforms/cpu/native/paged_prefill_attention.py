"""Causal prefill attention over the paged pool, blocked like a GEMM (`paged_prefill_attention.c`).

Used by the torch backend (`model/attention/torch_paged.py`, through `paged_attention.py`) for
every query chunk of more than one token in a step, fresh prompts and chunks continuing a cached
context alike, for float32 and bfloat16 pools on AVX2 CPUs, through AVX-512 tiles where the CPU has them (a
bfloat16 pool's keys and values are multiplied as bfloat16 pairs with vdpbf16ps, against
probabilities rounded to bfloat16, where the CPU has avx512_bf16, and widened to float32 as they
are packed elsewhere). The CPU
flash kernel behind F.scaled_dot_product_attention reaches about a third of the matmul peak on
causal prefill, and a chunk over a cached context first needs a gathered copy of it; this
kernel packs each head's keys once and runs register-tiled QK^T and PV products over them (see
docs/architecture.md).
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Callable

import torch

from prefixserve.model.kv_layout import ROWS, check_layout, pool_geometry
from prefixserve.platforms.cpu.panels import LAYOUT_CODES, PANELS
from prefixserve.platforms.cpu.native.build import load_default, load_kernel
from prefixserve.platforms.cpu.native.isa import AVX2, BODY_CODES, ISAS, best_isa, reads_panels


class PagedPrefillAttention:
    """`__call__(q, kv_cache, query_start_loc, seq_lens, tables, scale)` -> out [T, H, D].

    Sequence b's queries are rows query_start_loc[b]:query_start_loc[b + 1] of q [T, H, D];
    they are the last of its seq_lens[b] positions, whose K/V are already in the pool
    kv_cache (model/kv_layout.py, panels.py: rows [2, num_blocks, block_size, KVH, D] or, for the AVX-512 tiles, panels)
    at the blocks tables[b]. Each query attends
    causally (to the keys up to its own position); query head j reads KV head j // (H / KVH).
    """

    def __init__(self, library: ctypes.CDLL, body: str | None = None, layout: str = ROWS) -> None:
        self._fn = library.paged_prefill_attention
        self._fn.restype = None
        self._fn.argtypes = ([ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_int]
                             + [ctypes.c_void_p] * 3 + [ctypes.c_long] * 8
                             + [ctypes.c_float] + [ctypes.c_void_p] * 2 + [ctypes.c_int] * 3)
        self._workspace = library.paged_prefill_workspace
        self._workspace.restype = ctypes.c_long
        self._workspace.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_long] * 6 + [ctypes.c_int]
        self._library = library
        # the widest tiles the CPU runs (torch asks the CPU and the OS): AVX-512 gives the AVX2 bits;
        # with avx512_bf16 a bfloat16 pool's keys are multiplied in bfloat16 pairs, summed in float32
        self.body = best_isa() if body is None else body
        if self.body not in ISAS:
            raise ValueError(f"unknown body {self.body!r}; one of {ISAS}")
        check_layout(layout)
        if layout == PANELS and self.body == AVX2:
            raise ValueError(f"a pool of panels needs AVX-512 tiles, not the {AVX2} body")
        self.layout = layout

    def with_body(self, body: str) -> "PagedPrefillAttention":
        """The same library through other tiles (tests compare them; the caller checks the CPU)."""
        return PagedPrefillAttention(self._library, body, self.layout)

    def for_layout(self, layout: str) -> "PagedPrefillAttention":
        """The same library and tiles over pools laid out in `layout` (model/kv_layout.py, panels.py)."""
        return self if layout == self.layout else PagedPrefillAttention(self._library, self.body, layout)

    @staticmethod
    def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        # Queries and output are in the pool's dtype: the kernel reads bfloat16 queries as they are
        # and rounds each float32 output row once as it stores it.
        return (q.device.type == "cpu" and kv_cache.device.type == "cpu" and kv_cache.is_contiguous()
                and q.dtype == kv_cache.dtype and q.dtype in (torch.float32, torch.bfloat16)
                and q.shape[-1] % 8 == 0)

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                 seq_lens: torch.Tensor, tables: torch.Tensor, scale: float, *, out: torch.Tensor | None = None,
                 min_query_len: int = 1,
                 scratch: Callable[[int], torch.Tensor] | None = None) -> torch.Tensor:
        """Writes the rows of the sequences with at least min_query_len queries into `out` (a new
        tensor, zero elsewhere, when not given; the other rows of a given one are left as they are)
        and returns it. `scratch(n)`: at least n contiguous
        float32 elements the call may overwrite (each served sequence's keys, packed per KV head), for
        callers that keep one buffer across calls; a fresh tensor when None."""
        tokens, heads, head_dim = q.shape
        num_blocks, block_size, kv_heads, pool_dim = pool_geometry(kv_cache, self.layout)
        if self.layout == PANELS and not reads_panels(self.body, kv_cache.dtype):
            raise ValueError(f"the {self.body} tiles do not read a {kv_cache.dtype} pool of panels")
        batch = seq_lens.shape[0]
        if (pool_dim != head_dim or heads % kv_heads or query_start_loc.shape != (batch + 1,)
                or tables.dim() != 2 or tables.shape[0] != batch):
            raise ValueError(f"shapes do not match: q {tuple(q.shape)}, pool {tuple(kv_cache.shape)}, "
                             f"query_start_loc {tuple(query_start_loc.shape)}, seq_lens {tuple(seq_lens.shape)}, "
                             f"tables {tuple(tables.shape)}")
        if not self.supports(q, kv_cache):
            raise ValueError("needs float32 or bfloat16 CPU tensors (q and pool alike), a contiguous pool "
                             "and head_dim % 8 == 0")
        if tables.dtype != torch.int64 or seq_lens.dtype != torch.int64 or query_start_loc.dtype != torch.int64:
            raise ValueError("query_start_loc, seq_lens and tables must be int64")
        query_start_loc, seq_lens, tables = query_start_loc.contiguous(), seq_lens.contiguous(), tables.contiguous()
        # sizes the scratch and checks the lengths, in C: tensor ops here would cost more than small calls
        need = self._workspace(seq_lens.data_ptr(), query_start_loc.data_ptr(), batch, kv_heads, head_dim,
                               min_query_len, tokens, tables.shape[1] * block_size, LAYOUT_CODES[self.layout])
        if need < 0:
            raise ValueError(_ERRORS[need])
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            q = q.contiguous()
        if out is None:
            out = torch.zeros(tokens, heads, head_dim, dtype=kv_cache.dtype)
        elif out.shape != q.shape or out.dtype != kv_cache.dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {kv_cache.dtype} tensor of shape {tuple(q.shape)}")
        work = torch.empty(need, dtype=torch.float32) if scratch is None else scratch(need)
        if work.numel() < need or work.dtype != torch.float32 or not work.is_contiguous():
            raise ValueError(f"scratch must give {need} contiguous float32 elements")
        self._fn(q.data_ptr(), q.stride(0), kv_cache.data_ptr(), int(kv_cache.dtype == torch.bfloat16),
                 tables.data_ptr(), seq_lens.data_ptr(), query_start_loc.data_ptr(), batch, heads, kv_heads,
                 head_dim, num_blocks, block_size, tables.shape[1], min_query_len, scale, out.data_ptr(),
                 work.data_ptr(), BODY_CODES[self.body], LAYOUT_CODES[self.layout], torch.get_num_threads())
        return out


_ERRORS = {-1: "query_start_loc must rise within the rows of q",
           -2: "a sequence has more queries than positions",
           -3: "a length runs past its block table"}


def _agrees_with_torch(kernel: PagedPrefillAttention) -> bool:
    """Two sequences (a fresh prompt, a chunk over a cached prefix) against masked plain matmuls, on a
    float32 pool and on the same values held in bfloat16 (head dim 32: the dot-product body serves
    whole 16-element rows)."""
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(2, 7, 4, 2, 32, generator=gen).bfloat16().float()
    q = torch.randn(8, 4, 32, generator=gen).bfloat16().float()
    tables = torch.tensor([[3, 0, 0], [5, 1, 6]])
    starts, lens = torch.tensor([0, 3, 8]), torch.tensor([3, 11])
    out = kernel(q, pool, starts, lens, tables, 0.25)
    half = kernel(q.bfloat16(), pool.bfloat16(), starts, lens, tables, 0.25)
    for b in range(2):
        keys = pool[0][tables[b]].flatten(0, 1)[: lens[b]].repeat_interleave(2, dim=1).transpose(0, 1)
        values = pool[1][tables[b]].flatten(0, 1)[: lens[b]].repeat_interleave(2, dim=1).transpose(0, 1)
        rows = q[starts[b]: starts[b + 1]].transpose(0, 1)
        n = rows.shape[1]
        visible = torch.ones(n, int(lens[b]), dtype=torch.bool).tril(int(lens[b]) - n)
        weights = (rows @ keys.transpose(-1, -2) * 0.25).masked_fill(~visible, float("-inf")).softmax(-1)
        want = (weights @ values).transpose(0, 1)
        if not torch.allclose(out[starts[b]: starts[b + 1]], want, atol=1e-5):
            return False
        # in bfloat16 within a rounding of each probability and one of the output, of sum p |v| where
        # the output cancels (the bfloat16 body rounds P for its P V products)
        terms = (weights @ values.abs()).transpose(0, 1)
        if not ((half[starts[b]: starts[b + 1]].float() - want).abs() <= 2 ** -7 * (want.abs() + terms) + 1e-5).all():
            return False
    return True


def load(cc: str | None, out_dir: Path) -> PagedPrefillAttention | None:
    """Build and load the kernel, checked against plain matmuls on a probe; None where it cannot be used."""
    return load_kernel("paged_prefill_attention", cc, out_dir, PagedPrefillAttention, _agrees_with_torch)


@functools.cache
def default_kernel() -> PagedPrefillAttention | None:
    """The process's kernel, built on first use; None where unavailable or turned off."""
    return load_default("paged_prefill_attention", PagedPrefillAttention, _agrees_with_torch)
