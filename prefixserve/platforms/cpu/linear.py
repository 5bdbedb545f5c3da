"""The CPU platform's dense projections, routed to the fastest matmul kernel for the shape.

A packed weight (`packed_weight.py`: every projection of a bfloat16 model on a CPU with avx512_bf16,
of a float32 model on a CPU with AVX-512) takes the packed kernel at every row count. For row-major
weights:
up to `native.small_m_gemm.MAX_ROWS` rows on an AVX2 CPU, the project's own kernel
(`native/small_m_gemm.c`) streams each weight once at nearly the memory bandwidth. Otherwise,
on CPU, F.linear calls MKL's sgemm, which on this project's machines (AMD EPYC, 2
threads) streams a weight at 2-10 GB/s when 1-16 rows multiply it: exactly the
shape of decode steps. oneDNN's linear, the kernel torch.compile's CPU backend
emits, is 1.3-3x faster at those sizes and 1.1-1.3x faster at prefill sizes
(see benchmarks/model_micro.py). It is reached through an internal operator,
so its presence is checked once and F.linear stays the fallback.

oneDNN builds (JIT-compiles) a primitive for every distinct (rows, in, out), 0.55-0.7 MB and
1-1.75 ms each, and keeps it in two LRU caches, its own and ideep's (torch's wrapper), of 1024
entries by default; its memory comes back only once both have dropped it. Fed each step's
token count, a server grew by ~0.9 GB per 1,000 distinct prompt lengths. Two bounds:
- both caches hold at most PRIMITIVE_CACHE_CAPACITY entries. oneDNN and ideep read their
  capacities from the environment once, at oneDNN's first use in the process, so they are set
  here, before the probe below (a process that used oneDNN before importing this keeps 1024);
  an operator's own values win.
- products too small to amortise a new primitive get their rows padded to a few sizes per
  octave (`onednn_rows`): every product of the tiny models, few-row products of larger ones.
  A step builds a new primitive once and every layer reuses it, while padding (a copy and
  extra rows) costs 7-17% of every layer's product (0.6B shapes, 100-1000 rows, 2-vCPU Xeon):
  it pays only for products well under a millisecond. A tiny-model server then settles on
  ~150 primitives instead of building four a step.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from prefixserve.model.prepared_weight import PreparedWeight
from prefixserve.platforms.cpu.native.small_m_gemm import SmallMGemm, default_kernel

_ONEDNN_DTYPES = (torch.float32,)
# On CPU, F.linear in these dtypes goes to oneDNN's matmul, which keeps a primitive per shape too.
_ONEDNN_MATMUL_DTYPES = (torch.bfloat16, torch.float16)

PRIMITIVE_CACHE_CAPACITY = 256
EXACT_ROWS = 32          # up to here every row count is its own shape: few, and mostly the small-M kernel's
ROW_STEP_MIN = 16
STEPS_PER_OCTAVE = 8     # padding adds at most 1/STEPS_PER_OCTAVE of the rows (beyond 8 * ROW_STEP_MIN)
# rows * in * out up to which rows are padded: ~0.3-0.5 ms of compute here
PAD_MAX_MACS = 1 << 26


def _bound_primitive_caches() -> None:
    # oneDNN also reads the older DNNL_ name; a value given under either name is left alone
    if "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in os.environ and "DNNL_PRIMITIVE_CACHE_CAPACITY" not in os.environ:
        os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(PRIMITIVE_CACHE_CAPACITY)
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(PRIMITIVE_CACHE_CAPACITY))


def _onednn_linear_available() -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        probe = torch.ones(2, 4)
        out = torch.ops.mkldnn._linear_pointwise(probe, torch.ones(3, 4), None, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    return torch.equal(out, F.linear(probe, torch.ones(3, 4)))


_bound_primitive_caches()
ONEDNN_LINEAR = _onednn_linear_available()


def onednn_rows(m: int, k: int = 1, n: int = 1) -> int:
    """The row count oneDNN is given for an [m, k] x [k, n] product: m itself up to EXACT_ROWS or
    beyond PAD_MAX_MACS, else m rounded up to a multiple of
    max(ROW_STEP_MIN, 2**ceil(log2 m) / (2 * STEPS_PER_OCTAVE))."""
    if m <= EXACT_ROWS or m * k * n > PAD_MAX_MACS:
        return m
    step = max(ROW_STEP_MIN, (1 << (m - 1).bit_length()) // (2 * STEPS_PER_OCTAVE))
    return -(-m // step) * step


def _padded(fn, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fn(x, weight, bias) computed on x's rows padded with zeros to `onednn_rows`; padded rows are
    dropped from the result, which stays contiguous (leading rows of a row-major buffer)."""
    k, n = x.shape[-1], weight.shape[0]
    m = x.numel() // k if k else 0
    rows = onednn_rows(m, k, n)
    if rows == m:
        return fn(x, weight, bias)
    out = fn(F.pad(x.reshape(m, k), (0, 0, 0, rows - m)), weight, bias)
    return out[:m].view(*x.shape[:-1], n)


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor | PreparedWeight, bias: torch.Tensor | None = None,
           widened: bool = False) -> torch.Tensor:
    """x [..., in] @ weight[out, in].T (+ bias), like F.linear; `widened`: as `.float()` of that (a packed
    weight stores it so in the same pass, the others widen after it)."""
    if isinstance(weight, PreparedWeight):
        return weight.matmul(x, bias, widened)
    y = _linear(x, weight, bias)
    return y.float() if widened else y


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return F.linear(x, weight, bias)  # neither fast kernel has a backward
    if SmallMGemm.supports(x, weight, bias) and (kernel := default_kernel()) is not None:
        return kernel(x, weight, bias)
    if x.device.type == "cpu":
        if ONEDNN_LINEAR and x.dtype in _ONEDNN_DTYPES and x.is_contiguous():
            return _padded(_onednn_linear, x, weight, bias)
        if x.dtype in _ONEDNN_MATMUL_DTYPES:
            return _padded(F.linear, x, weight, bias)
    return F.linear(x, weight, bias)
