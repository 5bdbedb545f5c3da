"""Fused pointwise Triton kernels of a layer: RMSNorm with the residual add, the q/k per-head norm with
rotary, and SiLU-and-multiply. Each reads its operands once and writes its results once, where torch
runs three to six ops and as many round trips through memory.

Arithmetic is float32 inside, rounded once to the tensor's dtype, except where the reference rounds
between steps on purpose (the residual sum is stored in the model's dtype and normalised as stored; the
normalised row is rounded before the weight, the order HF uses). Operands are contiguous rows; the
platform falls back to torch for anything else.
"""
from __future__ import annotations

import torch
import triton.language as tl

from prefixserve.platforms.cuda.triton_runtime import compiled, next_power_of_2


def rms_norm_kernel(X, RESIDUAL, W, OUT, width, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < width
    x = tl.load(X + row * width + offs, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(RESIDUAL + row * width + offs, mask=ok, other=0.0).to(tl.float32))
        x = x.to(RESIDUAL.dtype.element_ty)
        tl.store(RESIDUAL + row * width + offs, x, mask=ok)
    xf = x.to(tl.float32)
    normed = xf * tl.rsqrt(tl.sum(xf * xf, 0) / width + eps)
    w = tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)
    y = normed.to(OUT.dtype.element_ty).to(tl.float32) * w
    tl.store(OUT + row * width + offs, y.to(OUT.dtype.element_ty), mask=ok)


def qk_norm_rope_kernel(QKV, Q_W, K_W, COS, SIN, Q_OUT, K_OUT, stride_t, num_heads, eps,
                        HAS_NORM: tl.constexpr, HEAD_DIM: tl.constexpr, HALF_P2: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)       # 0..H-1 query heads, then the KV heads
    half = HEAD_DIM // 2
    offs = tl.arange(0, HALF_P2)
    ok = offs < half
    base = QKV + token * stride_t + head * HEAD_DIM
    x1 = tl.load(base + offs, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + half + offs, mask=ok, other=0.0).to(tl.float32)
    is_q = head < num_heads
    if HAS_NORM:
        scale = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / HEAD_DIM + eps)
        w1 = tl.where(is_q, tl.load(Q_W + offs, mask=ok, other=0.0), tl.load(K_W + offs, mask=ok, other=0.0))
        w2 = tl.where(is_q, tl.load(Q_W + half + offs, mask=ok, other=0.0),
                      tl.load(K_W + half + offs, mask=ok, other=0.0))
        dtype = QKV.dtype.element_ty
        x1 = (x1 * scale).to(dtype).to(tl.float32) * w1.to(tl.float32)
        x2 = (x2 * scale).to(dtype).to(tl.float32) * w2.to(tl.float32)
        x1 = x1.to(dtype).to(tl.float32)
        x2 = x2.to(dtype).to(tl.float32)
    cos = tl.load(COS + token * half + offs, mask=ok, other=0.0).to(tl.float32)
    sin = tl.load(SIN + token * half + offs, mask=ok, other=0.0).to(tl.float32)
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    if is_q:
        dest = Q_OUT + (token * num_heads + head) * HEAD_DIM
    else:
        dest = K_OUT + (token * (tl.num_programs(1) - num_heads) + head - num_heads) * HEAD_DIM
    tl.store(dest + offs, y1.to(Q_OUT.dtype.element_ty), mask=ok)
    tl.store(dest + half + offs, y2.to(Q_OUT.dtype.element_ty), mask=ok)


def silu_and_mul_kernel(GATE_UP, OUT, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < width
    gate = tl.load(GATE_UP + row * 2 * width + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(GATE_UP + row * 2 * width + width + offs, mask=ok, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(OUT + row * width + offs, y.to(OUT.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """rms_norm(x) over the last dim; with `residual`: residual += x first (in place, in x's dtype) and
    the sum is normalised."""
    width = x.shape[-1]
    rows = x.numel() // width
    out = torch.empty_like(x)
    compiled(rms_norm_kernel, x.device.type)[(rows,)](
        x, residual if residual is not None else x, weight, out, width, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=next_power_of_2(width), num_warps=_warps(width))
    return out


def qk_norm_rope(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                 q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D] and k [T, KVH, D], each normed per head where the weights are given, and rotated;
    cos and sin [T, 1, D / 2] contiguous."""
    tokens = qkv.shape[0]
    q = torch.empty((tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((tokens, num_kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    has_norm = q_weight is not None and k_weight is not None
    compiled(qk_norm_rope_kernel, qkv.device.type)[(tokens, num_heads + num_kv_heads)](
        qkv, q_weight if has_norm else cos, k_weight if has_norm else cos, cos, sin, q, k, qkv.stride(0),
        num_heads, eps, HAS_NORM=has_norm, HEAD_DIM=head_dim, HALF_P2=next_power_of_2(head_dim // 2),
        num_warps=1)
    return q, k


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of [T, 2I] rows: [T, I]."""
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, width), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, next_power_of_2(width))
    compiled(silu_and_mul_kernel, gate_up.device.type)[(rows, -(-width // block))](
        gate_up, out, width, BLOCK=block, num_warps=4)
    return out


def _warps(width: int) -> int:
    return 8 if width >= 4096 else 4 if width >= 1024 else 1
