"""The GEMM over packed weights (`packed_gemm.c`) behind `platforms/cpu/packed_weight.py`.

Used for every projection of a bfloat16 model on a CPU with avx512_bf16 and of a float32 model on a CPU
with AVX-512, at every row count: one kernel whose row results do not depend on the batch, so prefix
caching stays exact, and faster than both the row-major few-row kernel and oneDNN from decode to
prefill sizes (see the C file). Where the CPU has AMX and the OS grants it (`PackedGemm.tiles`), bfloat16
weights whose k is a multiple of `PackedGemm.tile_k` take the tile body instead, at every row count too.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from prefixserve.platforms.cpu.native.build import load_default, load_kernel
from prefixserve.platforms.cpu.native.isa import AVX512, AVX512_BF16, best_isa

PANEL = 64      # output columns per panel (the C file's PANEL)
# elements of k per step of the kernel (the C file's STEP): a bfloat16 pair for vdpbf16ps, one float32 for FMA
STEP = {torch.bfloat16: 2, torch.float32: 1}
_FUNCTIONS = {torch.bfloat16: "packed_gemm_bf16", torch.float32: "packed_gemm_f32"}
# per dtype, the function whose results are that dtype's, stored widened to float32 (float32's: its own)
_WIDENED = {torch.bfloat16: "packed_gemm_bf16_widened", torch.float32: "packed_gemm_f32"}
# the C file built with its tiles emulated in C (for tests on CPUs without AMX)
EMULATE_TILES = "PACKED_GEMM_EMULATE_TILES"
# PREFIXSERVE_AMX=0 in the environment when the library loads: bfloat16 stays on the vector body
AMX_ENV = "PREFIXSERVE_AMX"


def panel_shape(n: int, k: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """The packed layout of a [n, k] weight: [ceil(n / PANEL), k / STEP, PANEL, STEP]."""
    step = STEP[dtype]
    return -(-n // PANEL), k // step, PANEL, step


def pack(weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Writes W[n, k] (k a whole number of steps) into out (`panel_shape`) in the kernel's layout; the last
    panel's missing columns are left as `out` has them (never read into a result)."""
    n, k = weight.shape
    step = out.shape[-1]
    full = n // PANEL
    if full:
        out[:full].copy_(weight[:full * PANEL].view(full, PANEL, k // step, step).permute(0, 2, 1, 3))
    if n % PANEL:
        out[full, :, :n % PANEL].copy_(weight[full * PANEL:].view(n % PANEL, k // step, step).permute(1, 0, 2))
    return out


def runnable_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes whose body this CPU runs: float32 with AVX-512, bfloat16 too with avx512_bf16."""
    isa = best_isa()
    return (torch.float32, torch.bfloat16) if isa == AVX512_BF16 else (torch.float32,) if isa == AVX512 else ()


class PackedGemm:
    """The loaded kernel: `__call__(x, panels, n, bias)` for x [m, k] contiguous and `pack`'s panels, both in
    one of `dtypes`."""

    def __init__(self, library: ctypes.CDLL, dtypes: tuple[torch.dtype, ...] | None = None) -> None:
        self.dtypes = runnable_dtypes() if dtypes is None else dtypes
        # whether bfloat16 products of a k that is a multiple of tile_k run on AMX tiles (read by the library
        # when it loads: the CPU's AMX-TILE, AMX-BF16 and avx512_bf16, the OS's permission, and AMX_ENV)
        self.tiles = bool(library.packed_gemm_tiles())
        self.tile_k = int(library.packed_gemm_tile_k())
        # per dtype (x, panels, bias or 0, y, m, n, k, threads); public, unchecked, for callers that check their
        # operands once and call it many times (platforms/cpu/decode_program.py)
        self.functions, self._widened = {}, {}
        for dtype in self.dtypes:
            for table, name in ((self.functions, _FUNCTIONS[dtype]), (self._widened, _WIDENED[dtype])):
                fn = getattr(library, name)
                fn.restype = None
                fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
                table[dtype] = fn

    def __call__(self, x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
        m, k = x.shape
        if (panels.dtype not in self.functions or not panels.is_contiguous()
                or panels.shape != panel_shape(n, k, panels.dtype)):
            raise ValueError(f"x {tuple(x.shape)} does not fit panels {tuple(panels.shape)} {panels.dtype} "
                             f"of {n} columns")
        if bias is not None and bias.shape != (n,):
            raise ValueError(f"bias {tuple(bias.shape)} for {n} columns")
        return self.product(x, panels, n, None if bias is None else bias.float().contiguous())

    def product(self, x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None,
                widened: bool = False) -> torch.Tensor:
        """`__call__` for panels already checked against n and k (a PackedWeight's own, checked when it
        packed them: per projection the checks cost as much as the call) and a float32 bias or None.
        `widened`: the same results (rounded to x's dtype) returned as float32, as `.float()` of them."""
        m, k = x.shape
        step = panels.shape[-1]
        if x.dtype != panels.dtype or not x.is_contiguous() or k % step or k != step * panels.shape[1]:
            raise ValueError(f"x {tuple(x.shape)} {x.dtype} (contiguous: {x.is_contiguous()}) does not fit "
                             f"panels {tuple(panels.shape)} {panels.dtype}")
        y = torch.empty(m, n, dtype=torch.float32 if widened else x.dtype)
        if m and n:
            (self._widened if widened else self.functions)[x.dtype](
                x.data_ptr(), panels.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(), m, n, k,
                torch.get_num_threads())
        return y


def _agrees_with_torch(kernel: PackedGemm) -> bool:
    gen = torch.Generator().manual_seed(0)
    # k = 24 takes the vector body; k = 64 the tile body too where there is one (two steps, two row groups)
    for m, k in ((7, 24), (17, 2 * kernel.tile_k)):
        x, w, b = torch.randn(m, k, generator=gen), torch.randn(70, k, generator=gen), torch.randn(70, generator=gen)
        for dtype in kernel.dtypes:
            xd, wd, bd = x.to(dtype), w.to(dtype), b.to(dtype)
            panels = pack(wd, torch.zeros(panel_shape(70, k, dtype), dtype=dtype))
            exact = torch.addmm(bd.double(), xd.double(), wd.double().T)
            if not torch.allclose(kernel(xd, panels, 70, bd).double(), exact, rtol=1e-2, atol=1e-2):
                return False
    return True


def load(cc: str | None, out_dir: Path, emulate_tiles: bool = False) -> PackedGemm | None:
    """Build and load the kernel, checked against torch on a probe; None where it cannot be used.
    emulate_tiles: a build whose bfloat16 products take the tile body on tiles emulated in C, on any CPU
    with avx512_bf16 (slow; for checking the tile body where there is no AMX)."""
    return load_kernel("packed_gemm", cc, out_dir, PackedGemm, _agrees_with_torch, needs_avx512=True,
                       defines=(EMULATE_TILES,) if emulate_tiles else ())


@functools.cache
def default_kernel() -> PackedGemm | None:
    """The process's kernel, built on first use; None where the CPU lacks AVX-512, or it is unavailable or
    turned off."""
    return load_default("packed_gemm", PackedGemm, _agrees_with_torch, needs_avx512=True)
