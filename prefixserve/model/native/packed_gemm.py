"""The bfloat16 GEMM over packed weights (`packed_gemm.c`) behind `model/packed_weight.py`.

Used for every bfloat16 projection on a CPU with avx512_bf16, at every row count: one kernel whose row
results do not depend on the batch, so prefix caching stays exact in bfloat16, and faster than both
the row-major few-row kernel and oneDNN from decode to prefill sizes (see the C file).
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from prefixserve.model.native.build import load_default, load_kernel

PANEL = 64      # output columns per panel (the C file's PANEL)


def pack(weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Writes W[n, k] (k even) into out [ceil(n / PANEL), k / 2, PANEL, 2] in the kernel's layout; the
    last panel's missing columns are left as `out` has them (never read into a result)."""
    n, k = weight.shape
    full = n // PANEL
    if full:
        out[:full].copy_(weight[:full * PANEL].view(full, PANEL, k // 2, 2).permute(0, 2, 1, 3))
    if n % PANEL:
        out[full, :, :n % PANEL].copy_(weight[full * PANEL:].view(n % PANEL, k // 2, 2).permute(1, 0, 2))
    return out


class PackedGemm:
    """The loaded kernel: `__call__(x, panels, n, bias)` for x [m, k] contiguous bfloat16 and `pack`'s panels."""

    def __init__(self, library: ctypes.CDLL) -> None:
        # (x, panels, bias or 0, y, m, n, k, threads); public, unchecked, for callers that check their operands
        # once and call it many times (model/decode_program.py)
        self.function = library.packed_gemm_bf16
        self.function.restype = None
        self.function.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]

    def __call__(self, x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
        m, k = x.shape
        if (panels.dtype != torch.bfloat16 or not panels.is_contiguous()
                or panels.shape != (-(-n // PANEL), k // 2, PANEL, 2)):
            raise ValueError(f"x {tuple(x.shape)} does not fit panels {tuple(panels.shape)} {panels.dtype} "
                             f"of {n} columns")
        if bias is not None and bias.shape != (n,):
            raise ValueError(f"bias {tuple(bias.shape)} for {n} columns")
        return self.product(x, panels, n, None if bias is None else bias.float().contiguous())

    def product(self, x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        """`__call__` for panels already checked against n and k (a PackedWeight's own, checked when it
        packed them: per projection the checks cost as much as the call) and a float32 bias or None."""
        m, k = x.shape
        if x.dtype != torch.bfloat16 or not x.is_contiguous() or k % 2 or k != 2 * panels.shape[1]:
            raise ValueError(f"x {tuple(x.shape)} {x.dtype} (contiguous: {x.is_contiguous()}) does not fit "
                             f"panels {tuple(panels.shape)}")
        y = torch.empty(m, n, dtype=torch.bfloat16)
        if m and n:
            self.function(x.data_ptr(), panels.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(),
                     m, n, k, torch.get_num_threads())
        return y


def _agrees_with_torch(kernel: PackedGemm) -> bool:
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(7, 24, generator=gen).bfloat16(), torch.randn(70, 24, generator=gen).bfloat16(),
               torch.randn(70, generator=gen).bfloat16())
    panels = pack(w, torch.zeros(2, 12, PANEL, 2, dtype=torch.bfloat16))
    exact = torch.addmm(b.double(), x.double(), w.double().T)
    return torch.allclose(kernel(x, panels, 70, b).double(), exact, rtol=1e-2, atol=1e-2)


def load(cc: str | None, out_dir: Path) -> PackedGemm | None:
    """Build and load the kernel, checked against torch on a probe; None where it cannot be used."""
    return load_kernel("packed_gemm", cc, out_dir, PackedGemm, _agrees_with_torch, needs_avx512_bf16=True)


@functools.cache
def default_kernel() -> PackedGemm | None:
    """The process's kernel, built on first use; None where the CPU lacks avx512_bf16, or it is unavailable
    or turned off."""
    return load_default("packed_gemm", PackedGemm, _agrees_with_torch, needs_avx512_bf16=True)
