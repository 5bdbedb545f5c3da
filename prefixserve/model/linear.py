"""Dense projections routed to the fastest matmul kernel for the shape and device.

Up to `native.small_m_gemm.MAX_ROWS` rows on an AVX2 CPU, the project's own kernel
(`native/small_m_gemm.c`) streams each weight once at nearly the memory bandwidth. Otherwise,
on CPU, F.linear calls MKL's sgemm, which on this project's machines (AMD EPYC, 2
threads) streams a weight at 2-10 GB/s when 1-16 rows multiply it: exactly the
shape of decode steps. oneDNN's linear, the kernel torch.compile's CPU backend
emits, is 1.3-3x faster at those sizes and 1.1-1.3x faster at prefill sizes
(see benchmarks/model_micro.py). It is reached through an internal operator,
so its presence is checked once and F.linear stays the fallback.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from prefixserve.model.native.small_m_gemm import SmallMGemm, default_kernel

_ONEDNN_DTYPES = (torch.float32,)


def _onednn_linear_available() -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        probe = torch.ones(2, 4)
        out = torch.ops.mkldnn._linear_pointwise(probe, torch.ones(3, 4), None, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    return torch.equal(out, F.linear(probe, torch.ones(3, 4)))


ONEDNN_LINEAR = _onednn_linear_available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight[out, in].T (+ bias), like F.linear."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return F.linear(x, weight, bias)  # neither fast kernel has a backward
    if SmallMGemm.supports(x, weight, bias) and (kernel := default_kernel()) is not None:
        return kernel(x, weight, bias)
    if ONEDNN_LINEAR and x.device.type == "cpu" and x.dtype in _ONEDNN_DTYPES and x.is_contiguous():
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
