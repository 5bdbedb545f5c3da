"""Greedy sampling's argmax over each row of the logits (`row_argmax.c`): torch's answer, the first
index of the maximum (or of the first NaN), at about a tenth of torch's time on a CPU's vocabulary-wide
rows. Used by `worker/sampler.py` for float32 CPU logits."""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from prefixserve.platforms.cpu.native.build import load_default, load_kernel


class RowArgmax:
    """`__call__(x)` -> int64 [rows] for x [rows, n] float32 on the CPU."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fn = library.row_argmax
        self._fn.restype = None
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_int]

    @staticmethod
    def supports(x: torch.Tensor) -> bool:
        return x.dtype == torch.float32 and x.is_cpu and x.dim() == 2 and x.shape[1] > 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.supports(x):
            raise ValueError(f"row_argmax takes float32 CPU rows [rows, n > 0], not {tuple(x.shape)} {x.dtype}")
        x = x.contiguous()
        out = torch.empty(x.shape[0], dtype=torch.int64)
        if x.shape[0]:
            self._fn(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
        return out


def _agrees_with_torch(kernel: RowArgmax) -> bool:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 1003, generator=gen)
    x[1, 7] = x[1, 900] = 50.0                 # a tie: the first index
    x[2, :] = float("-inf")                      # nothing left: index 0
    x[3, 500], x[3, 600] = float("nan"), 1e9     # a NaN wins, as in torch
    return all(torch.equal(kernel(x[:rows]), torch.argmax(x[:rows], dim=-1)) for rows in (1, 5))


def load(cc: str | None, out_dir: Path) -> RowArgmax | None:
    """Build and load the kernel, checked against torch on a probe; None where it cannot be used."""
    return load_kernel("row_argmax", cc, out_dir, RowArgmax, _agrees_with_torch)


@functools.cache
def default_kernel() -> RowArgmax | None:
    """The process's kernel, built on first use; None where unavailable or turned off."""
    return load_default("row_argmax", RowArgmax, _agrees_with_torch)
