"""Decode attention over the paged pool without gathering (`paged_decode_attention.c`).

Used by the torch backend's decode path (`model/attention/torch_paged.py`, through
`platforms/cpu/paged_attention.py`) for float32 and bfloat16 pools on AVX2 CPUs: the
gather-then-attend path reads K/V three times (and widens a bfloat16 copy), this kernel once, in
the pool's own dtype, summing in float32 (the bfloat16 body rounds the probabilities to bfloat16
for P V, see attention_tiles.h). It runs the prefill kernel's tiles on the same body, so a token
gets the same bits from either kernel.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from prefixserve.model.kv_layout import ROWS, check_layout, pool_geometry
from prefixserve.platforms.cpu.panels import LAYOUT_CODES, PANELS
from prefixserve.platforms.cpu.native.build import load_default, load_kernel
from prefixserve.platforms.cpu.native.isa import AVX2, AVX512_BF16, BODY_CODES, ISAS, best_isa, reads_panels


@dataclass
class DecodeState:
    """Where an online softmax over a context's leading blocks left off, per query row: the unnormalised
    output `acc` [B, KVH, R, D], the running max `m` and denominator `l` [B, KVH, R], all float32, in
    base 2 (of the scores scaled by scale * log2 e, as the kernels' exp2 takes them). A later call
    carries on from it over the following blocks exactly as one pass over all of them would (the same
    operations in the same order, from a softmax tile's edge), which a merge of two finished halves
    does not."""
    acc: torch.Tensor
    m: torch.Tensor
    l: torch.Tensor

    @staticmethod
    def fresh(shape: torch.Size, filled: bool = True) -> "DecodeState":
        """A state for queries of `shape` [B, KVH, R, D]: where nothing was attended yet (filled), or left
        for calls that write every row before any call carries on from it."""
        if not filled:
            return DecodeState(torch.empty(shape), torch.empty(shape[:3]), torch.empty(shape[:3]))
        return DecodeState(torch.zeros(shape), torch.full(shape[:3], float("-inf")), torch.zeros(shape[:3]))


@dataclass(frozen=True)
class KernelTables:
    """Block tables [B, W] and lengths [B] as the kernel reads them (contiguous int64), checked once:
    a step's decode plan makes them and every layer's calls reuse them (the host-side checks cost
    more than the kernel on short contexts). With `members`, one shared run's table (B = 1) and the
    sequences that attend to it stacked (see `run_partial`)."""
    tables: torch.Tensor
    lens: torch.Tensor
    longest: int                        # max(lens), or 0
    whole_tiles: bool                   # every length a whole number of softmax tiles
    members: torch.Tensor | None = None
    sequences: int = 0                  # 1 + the largest member: the fewest sequences q must hold


class PagedDecodeAttention:
    """`__call__(q, kv_cache, tables, lens, scale)` -> (out [B, KVH, R, D], lse [B, KVH, R]);
    `partial(...)` -> the DecodeState a later `__call__(..., carry=state)` finishes. `tables(...)` checks
    tables and lengths once for `run` and `run_partial`, which take them checked."""

    def __init__(self, library: ctypes.CDLL, body: str | None = None, layout: str = ROWS) -> None:
        self._fn = library.paged_decode_attention
        self._fn.restype = None
        self._fn.argtypes = ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 2
                             + [ctypes.c_long] * 7 + [ctypes.c_float]
                             + [ctypes.c_void_p] * 4 + [ctypes.c_int] * 2 + [ctypes.c_void_p, ctypes.c_long]
                             + [ctypes.c_int] * 3 + [ctypes.c_void_p, ctypes.c_int])
        tile_keys = library.paged_attention_tile_keys
        tile_keys.restype = ctypes.c_long
        # a carried state gives one pass's bits only where it stops at a softmax tile's edge
        self.tile_keys = int(tile_keys())
        self._library = library
        # the prefill kernel's tiles on the same body (the same bits for the same token): the widest the
        # CPU runs, a bfloat16 pool's keys in bfloat16 pairs where it has avx512_bf16
        self.body = best_isa() if body is None else body
        if self.body not in ISAS:
            raise ValueError(f"unknown body {self.body!r}; one of {ISAS}")
        check_layout(layout)
        # a pool of panels is read by the bfloat16 tiles only
        if layout == PANELS and self.body == AVX2:
            raise ValueError(f"a pool of panels needs AVX-512 tiles, not the {AVX2} body")
        self.layout = layout

    def with_body(self, body: str) -> "PagedDecodeAttention":
        """The same library through other tiles (tests compare them; the caller checks the CPU)."""
        return PagedDecodeAttention(self._library, body, self.layout)

    def for_layout(self, layout: str) -> "PagedDecodeAttention":
        """The same library and tiles over pools laid out in `layout` (model/kv_layout.py, panels.py)."""
        return self if layout == self.layout else PagedDecodeAttention(self._library, self.body, layout)

    @staticmethod
    def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        # the call takes float32 queries (a bfloat16 model's widened first, unless the tiles read its own:
        # reads_query_words); the pool float32 or bfloat16
        return (q.device.type == "cpu" and q.dtype in (torch.float32, kv_cache.dtype) and kv_cache.device.type == "cpu"
                and kv_cache.dtype in (torch.float32, torch.bfloat16) and kv_cache.is_contiguous()
                and q.shape[-1] % 8 == 0)

    def reads_query_words(self, kv_cache: torch.Tensor, head_dim: int) -> bool:
        """Whether these tiles take a bfloat16 model's queries as they are, and can write its output in
        bfloat16: they read the pool's keys as bfloat16 word pairs (head dims of whole 16-element rows)."""
        return self.body == AVX512_BF16 and kv_cache.dtype == torch.bfloat16 and head_dim % 16 == 0

    def tables(self, tables: torch.Tensor, lens: torch.Tensor, members: torch.Tensor | None = None) -> KernelTables:
        """`tables` [B, W] and `lens` [B] (int64) checked and laid out for the kernel; `members` [M] (int64,
        distinct sequence indices) for a shared run's one table."""
        if tables.dim() != 2 or lens.shape != (tables.shape[0],):
            raise ValueError(f"tables {tuple(tables.shape)} and lens {tuple(lens.shape)} do not match")
        if tables.dtype != torch.int64 or lens.dtype != torch.int64:
            raise ValueError("tables and lens must be int64")
        host = lens.cpu().numpy()
        if (host < 0).any():
            raise ValueError("a length is negative")
        sequences = 0
        if members is not None:
            if members.dtype != torch.int64 or members.dim() != 1 or tables.shape[0] != 1:
                raise ValueError("members must be an int64 vector, over one table")
            picked = members.cpu().numpy()
            # a repeated member would have two rows write the same state
            if (picked < 0).any() or len(set(picked.tolist())) != len(picked):
                raise ValueError("members must be distinct sequence indices")
            members, sequences = members.contiguous(), int(picked.max()) + 1 if len(picked) else 0
        return KernelTables(tables.contiguous(), lens.contiguous(), int(host.max()) if len(host) else 0,
                            not (host % self.tile_keys).any(), members, sequences)

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                 scale: float, carry: DecodeState | None = None,
                 out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Finished attention over the blocks of `tables` (after `carry`'s, when given: its acc is
        finished in place and returned as out). q float32, or bfloat16 where `reads_query_words`; `out`
        (bfloat16, shaped like q, contiguous; there only) takes the output rounded to bfloat16, and is
        returned instead of an acc."""
        return self.run(q, kv_cache, self.tables(tables, lens), scale, carry, out)

    def partial(self, q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                scale: float) -> DecodeState:
        """The online softmax over the blocks of `tables`, left unfinished for a later call to carry on.
        Every length must be a whole number of softmax tiles (`tile_keys`): the call carrying on starts
        a tile where one pass over the whole context starts one, so the two give the same bits."""
        state = DecodeState.fresh(q.shape, filled=False)
        self.run_partial(q, kv_cache, self.tables(tables, lens), scale, state)
        return state

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, tables: KernelTables, scale: float,
            carry: DecodeState | None = None, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`__call__` over checked tables."""
        q = q.contiguous()      # held here: the arguments hold only its address
        arguments, state, lse = self.prepare_run(q, kv_cache, tables, scale, carry, out)
        self._fn(*arguments)
        return state.acc if out is None else out, lse

    def prepare_run(self, q: torch.Tensor, kv_cache: torch.Tensor, tables: KernelTables, scale: float,
                    carry: DecodeState | None = None,
                    out: torch.Tensor | None = None) -> tuple[list, DecodeState, torch.Tensor]:
        """`run` checked but not called: (the C call's arguments, the state it writes, whose acc becomes the
        output unless `out` takes it in bfloat16, lse). The arguments hold addresses only: the caller keeps
        q (contiguous), the pool, the tables, the state, out and lse alive.
        A caller running the same call over every layer's pool (pools of one shape and dtype) checks once
        and swaps the pool's pointer, argument 1 (platforms/cpu/decode_program.py, through native/decode_loop.c)."""
        if carry is None:
            state = DecodeState.fresh(q.shape, filled=False)
        else:
            state = carry
            self._check_state(state, q.shape, "carry")
        lse = torch.empty(q.shape[:3], dtype=torch.float32)
        if tables.members is not None:
            raise ValueError("a shared run's tables are for run_partial")
        if out is not None and (out.shape != q.shape or out.dtype != torch.bfloat16 or not out.is_contiguous()
                                or not self.reads_query_words(kv_cache, q.shape[-1])):
            raise ValueError(f"out must be a contiguous bfloat16 tensor shaped like q {tuple(q.shape)}, for tiles that "
                             "read a bfloat16 pool's keys as word pairs")
        return self._arguments(q, kv_cache, tables, scale, state, lse, carry is not None, True, out), state, lse

    def run_partial(self, q: torch.Tensor, kv_cache: torch.Tensor, tables: KernelTables, scale: float,
                    into: DecodeState) -> None:
        """`partial` over checked tables, written into `into` (shaped like q). Tables made with members
        hold one shared run, attended once with those sequences' queries (rows of q's first dimension)
        stacked as the rows of one task per KV head; only their rows of `into` are written."""
        q = q.contiguous()      # held here: the arguments hold only its address
        self._fn(*self.prepare_run_partial(q, kv_cache, tables, scale, into))

    def prepare_run_partial(self, q: torch.Tensor, kv_cache: torch.Tensor, tables: KernelTables, scale: float,
                            into: DecodeState) -> list:
        """`run_partial` checked but not called: the C call's arguments (see `prepare_run`)."""
        if not tables.whole_tiles:
            raise ValueError(f"a partial pass must cover whole tiles of {self.tile_keys} keys")
        self._check_state(into, q.shape, "into")
        if tables.sequences > q.shape[0]:
            raise ValueError(f"a member lies outside the {q.shape[0]} sequences of q")
        return self._arguments(q, kv_cache, tables, scale, into, None, False, False, None)

    @staticmethod
    def _check_state(state: DecodeState, shape: torch.Size, name: str) -> None:
        acc, m, l = state.acc, state.m, state.l
        if (acc.shape != shape or m.shape != shape[:3] or l.shape != m.shape or not acc.is_contiguous()
                or not m.is_contiguous() or not l.is_contiguous() or {acc.dtype, m.dtype, l.dtype} != {torch.float32}):
            raise ValueError(f"{name} must hold contiguous float32 acc [B, KVH, R, D], m and l [B, KVH, R] "
                             "matching q")

    def _arguments(self, q: torch.Tensor, kv_cache: torch.Tensor, tables: KernelTables, scale: float,
                   state: DecodeState, lse: torch.Tensor | None, carry_in: bool, finalize: bool,
                   out: torch.Tensor | None) -> list:
        """One C call's arguments, checked; lse: None for a partial pass (only a finished one writes it);
        out: None, or a finished pass's bfloat16 output (checked by the caller)."""
        if not q.is_contiguous():
            raise ValueError("q must be contiguous")
        batch, kv_heads, rows, head_dim = q.shape
        num_blocks, block_size, pool_heads, pool_dim = pool_geometry(kv_cache, self.layout)
        if self.layout == PANELS and not reads_panels(self.body, kv_cache.dtype):
            raise ValueError(f"the {self.body} tiles do not read a {kv_cache.dtype} pool of panels")
        width, members = tables.tables.shape[1], tables.members
        tasks, task_rows = (1, len(members) * rows) if members is not None else (batch, rows)
        if (pool_heads, pool_dim) != (kv_heads, head_dim) or tables.tables.shape[0] != tasks:
            raise ValueError(f"shapes do not match: q {tuple(q.shape)}, pool {tuple(kv_cache.shape)}, "
                             f"tables {tuple(tables.tables.shape)}")
        if tables.longest > width * block_size:
            raise ValueError("a length runs past its block table")
        q_words = q.dtype == torch.bfloat16 and self.reads_query_words(kv_cache, head_dim)
        if (q.dtype != torch.float32 and not q_words) or not self.supports(q, kv_cache):
            raise ValueError("needs float32 queries (bfloat16 ones where the tiles read the keys as word pairs), a "
                             "contiguous float32 or bfloat16 CPU pool and head_dim % 8 == 0")
        return [q.data_ptr(), kv_cache.data_ptr(), int(kv_cache.dtype == torch.bfloat16), tables.tables.data_ptr(),
                tables.lens.data_ptr(), tasks, kv_heads, task_rows, head_dim, num_blocks, block_size, width, scale,
                state.acc.data_ptr(), 0 if lse is None else lse.data_ptr(), state.m.data_ptr(), state.l.data_ptr(),
                int(carry_in), int(finalize), 0 if members is None else members.data_ptr(), rows,
                BODY_CODES[self.body], LAYOUT_CODES[self.layout], int(q_words), 0 if out is None else out.data_ptr(),
                torch.get_num_threads()]

    @property
    def function(self):
        """The C function `prepare_run` and `prepare_run_partial` give the arguments of."""
        return self._fn


def _agrees_with_torch(kernel: PagedDecodeAttention) -> bool:
    """A probe against plain matmuls, on a float32 pool and on the same values held in bfloat16 (head
    dim 32: the dot-product body serves whole 16-element rows; queries of bfloat16 values, as a
    bfloat16 model's are)."""
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(2, 5, 4, 2, 32, generator=gen).bfloat16().float()
    q = torch.randn(1, 2, 3, 32, generator=gen).bfloat16().float()
    tables, lens = torch.tensor([[3, 0, 4]]), torch.tensor([10])
    out, lse = kernel(q, pool, tables, lens, 0.25)
    half_out, half_lse = kernel(q, pool.bfloat16(), tables, lens, 0.25)
    keys = pool[0][tables[0]].flatten(0, 1)[:10].transpose(0, 1)[None]
    values = pool[1][tables[0]].flatten(0, 1)[:10].transpose(0, 1)[None]
    scores = q @ keys.transpose(-1, -2) * 0.25
    want_lse = scores.logsumexp(-1)
    weights = (scores - want_lse[..., None]).exp()
    want_out = weights @ values
    # in bfloat16 within a rounding of each probability, of sum p |v| where the output cancels (the
    # bfloat16 body rounds P for its P V products); the scores in another order
    terms = weights @ values.abs()
    if not (((half_out - want_out).abs() <= 2 ** -7 * (want_out.abs() + terms) + 1e-5).all()
            and torch.allclose(half_lse, lse, atol=1e-3)):
        return False
    return torch.allclose(out, want_out, atol=1e-5) and torch.allclose(lse, want_lse, atol=1e-5)


def load(cc: str | None, out_dir: Path) -> PagedDecodeAttention | None:
    """Build and load the kernel, checked against plain matmuls on a probe; None where it cannot be used."""
    return load_kernel("paged_decode_attention", cc, out_dir, PagedDecodeAttention, _agrees_with_torch)


@functools.cache
def default_kernel() -> PagedDecodeAttention | None:
    """The process's kernel, built on first use; None where unavailable or turned off."""
    return load_default("paged_decode_attention", PagedDecodeAttention, _agrees_with_torch)
