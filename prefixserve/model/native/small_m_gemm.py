"""The few-row projection kernel (`small_m_gemm.c`) behind `model/linear.py`.

Decode steps multiply 1-32 rows by each weight; on this project's CPUs the library
GEMMs reach a third to a half of the memory bandwidth there, and this kernel, which
reads every weight row once, reaches nearly all of it (see docs/architecture.md).
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from prefixserve.model.native.build import load_default, load_kernel

MAX_ROWS = 32           # beyond this the library GEMM's blocking wins (measured crossover ~32-48 rows)
K_MULTIPLE = 8          # one AVX2 register of float32


DTYPES = (torch.float32, torch.bfloat16)


class SmallMGemm:
    """The loaded kernel: `__call__(x, weight, bias)` for 2-D contiguous operands, all float32 or all bfloat16."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fns = {torch.float32: library.small_m_gemm, torch.bfloat16: library.small_m_gemm_bf16}
        for fn in self._fns.values():
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]

    @staticmethod
    def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        return (x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.shape[1] % K_MULTIPLE == 0
                and x.device.type == "cpu" and x.dtype in DTYPES and weight.dtype == x.dtype
                and x.is_contiguous() and weight.is_contiguous() and weight.device.type == "cpu"
                and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous())))

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        m, k = x.shape
        n = weight.shape[0]
        if weight.shape[1] != k or (bias is not None and bias.shape != (n,)):
            raise ValueError(f"shapes do not match: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                             f"bias {None if bias is None else tuple(bias.shape)}")
        if x.dtype not in DTYPES or weight.dtype != x.dtype:
            raise ValueError(f"x {x.dtype} and weight {weight.dtype} must both be float32 or both bfloat16")
        # bfloat16: only the weight is read as bfloat16; x (a few rows) and bias are widened here, and y is
        # accumulated in float32 and rounded once
        xf = x.float()
        bias = None if bias is None else bias.float()
        y = torch.empty(m, n, dtype=torch.float32)
        self._fns[x.dtype](xf.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(),
                           m, n, k, torch.get_num_threads())
        return y.to(x.dtype)


def _agrees_with_torch(kernel: SmallMGemm) -> bool:
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 24, generator=gen), torch.randn(13, 24, generator=gen), torch.randn(13, generator=gen)
    xb, wb, bb = x.bfloat16(), w.bfloat16(), b.bfloat16()
    return (torch.allclose(kernel(x, w, b), torch.addmm(b, x, w.T), rtol=1e-4, atol=1e-4)
            and torch.allclose(kernel(xb, wb, bb).float(), torch.addmm(bb.float(), xb.float(), wb.float().T),
                               rtol=1e-2, atol=1e-2))


def load(cc: str | None, out_dir: Path) -> SmallMGemm | None:
    """Build and load the kernel, checked against torch on a probe; None where it cannot be used."""
    return load_kernel("small_m_gemm", cc, out_dir, SmallMGemm, _agrees_with_torch)


@functools.cache
def default_kernel() -> SmallMGemm | None:
    """The process's kernel, built on first use; None where unavailable or turned off."""
    return load_default("small_m_gemm", SmallMGemm, _agrees_with_torch)
