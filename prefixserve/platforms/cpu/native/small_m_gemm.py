"""The few-row projection kernel (`small_m_gemm.c`) behind `platforms/cpu/linear.py`.

Decode steps multiply a few rows (1-64) by each weight; on this project's CPUs the
library GEMMs reach a third to a half of the memory bandwidth there, and this kernel,
which reads every weight row once, reaches nearly all of it, and with many rows keeps
the multiply units busy (see docs/architecture.md). The C file has three bodies; the
widest one the CPU runs is used (`best_isa`). Row-major weights only: a model's projections are
packed for `packed_gemm` instead where it runs their dtype (float32 with AVX-512, bfloat16 with
avx512_bf16), so here the AVX-512 float32 body serves row-major weights the model did not pack.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from prefixserve.platforms.cpu.native.build import load_default, load_kernel
from prefixserve.platforms.cpu.native.isa import AVX2, AVX512, AVX512_BF16, best_isa

K_MULTIPLE = 8          # one AVX2 register of float32
DTYPES = (torch.float32, torch.bfloat16)

# Rows up to which each body beats the library GEMM; beyond, the library's packing and blocking win.
# AVX2: crossover ~32-48 rows (AMD EPYC Zen 4, 2 threads). AVX-512 float32, on the 0.6B model's
# projection shapes with weights streamed from memory (Zen 5 EPYC, 2 threads, 2026-12-01): 1.3-1.5x
# oneDNN at 16-96 rows; 64 keeps the kernel's share to decode-sized batches.
MAX_ROWS_BY_ISA = {AVX2: 32, AVX512: 64, AVX512_BF16: 64}

# Fixed per process (the CPU's features, not a timing), so the same rows always take the same kernel.
BEST_ISA = best_isa()
MAX_ROWS = MAX_ROWS_BY_ISA[BEST_ISA]


class SmallMGemm:
    """The loaded kernel: `__call__(x, weight, bias)` for 2-D contiguous operands, all float32 or all bfloat16."""

    def __init__(self, library: ctypes.CDLL, isa: str | None = None) -> None:
        self.isa = isa or BEST_ISA
        if self.isa not in MAX_ROWS_BY_ISA:
            raise ValueError(f"unknown instruction set {self.isa!r}; one of {sorted(MAX_ROWS_BY_ISA)}")
        self._library = library
        avx512 = self.isa in (AVX512, AVX512_BF16)
        # bfloat16 weights: the AVX2 body widens each weight to float32 (AVX-512 CPUs too: their bfloat16
        # projections are packed for packed_gemm wherever vdpbf16ps exists)
        self._fns = {torch.float32: library.small_m_gemm_avx512 if avx512 else library.small_m_gemm,
                     torch.bfloat16: library.small_m_gemm_bf16}
        for fn in self._fns.values():
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]

    def with_isa(self, isa: str) -> "SmallMGemm":
        """The same library through another body (tests compare them; the caller checks the CPU runs it)."""
        return SmallMGemm(self._library, isa)

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
        bias = None if bias is None else bias.float()
        # bfloat16: x is widened here, y accumulated in float32 and rounded once
        xf = x.float()
        y = torch.empty(m, n, dtype=torch.float32)
        self._fns[x.dtype](xf.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(),
                           m, n, k, torch.get_num_threads())
        return y.to(x.dtype)


def runnable_isas() -> tuple[str, ...]:
    """The distinct bodies this CPU runs, AVX2 first (avx512_bf16 adds no body here: see packed_gemm)."""
    return (AVX2,) if BEST_ISA == AVX2 else (AVX2, AVX512)


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
