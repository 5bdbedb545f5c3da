"""The CUDA platform: the layer's pointwise ops as fused Triton kernels (pointwise.py), attention through
the "triton" backend (attention.py), GEMMs and everything else through torch (cuBLAS).

Each op takes its kernel where Triton is importable and the operands suit it (contiguous rows on a CUDA
device, nothing needing gradients) and falls back to `Platform`'s torch otherwise, so a CUDA machine
without Triton still runs, only slower. Triton is imported on the first kernel call, not here.
"""
from __future__ import annotations

from functools import cached_property
from typing import Any

import torch

from prefixserve.model.kv_layout import ROWS
from prefixserve.model.platform import Platform, register_platform
from prefixserve.platforms.cuda import attention  # noqa: F401  (registers the "triton" backend)
from prefixserve.platforms.cuda.triton_runtime import TritonUnavailable, prepare, triton_missing


def _plain(*tensors: torch.Tensor | None) -> bool:
    """Operands the kernels take: CUDA tensors, contiguous, outside autograd."""
    for t in tensors:
        if t is None:
            continue
        if t.device.type != "cuda" or not t.is_contiguous() or (torch.is_grad_enabled() and t.requires_grad):
            return False
    return True


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"

    @cached_property
    def _pointwise(self) -> Any:
        """The fused kernels' module, or None without Triton."""
        try:
            prepare("cuda")
        except TritonUnavailable:
            return None
        from prefixserve.platforms.cuda import pointwise
        return pointwise

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self._pointwise is not None and _plain(x, weight):
            return self._pointwise.rms_norm(x, weight, eps)
        return Platform.rms_norm(self, x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if self._pointwise is not None and x.shape == residual.shape and _plain(x, residual, weight):
            return self._pointwise.rms_norm(x, weight, eps, residual=residual), residual
        return Platform.add_rms_norm(self, x, residual, weight, eps)

    def qk_norm_rope(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                     q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                     cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if (self._pointwise is not None and qkv.dim() == 2 and head_dim % 2 == 0
                and _plain(qkv, q_weight, k_weight, cos, sin)):
            return self._pointwise.qk_norm_rope(qkv, num_heads, num_kv_heads, head_dim, q_weight, k_weight, eps,
                                                cos, sin)
        return Platform.qk_norm_rope(self, qkv, num_heads, num_kv_heads, head_dim, q_weight, k_weight, eps,
                                     cos, sin)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self._pointwise is not None and gate_up.dim() == 2 and _plain(gate_up):
            return self._pointwise.silu_and_mul(gate_up)
        return Platform.silu_and_mul(self, gate_up)

    def decode_program(self, model: Any, kv_caches: list[torch.Tensor], layout: str, *,
                       max_batch: int | None = None, max_blocks: int | None = None) -> Any:
        """Decode steps as CUDA graphs (graphs.py), where the model attends through the Triton backend over a
        rows pool on a CUDA device and the step limits are known."""
        if (max_batch is None or max_blocks is None or layout != ROWS or not kv_caches
                or kv_caches[0].device.type != "cuda"
                or not isinstance(getattr(model, "attention_backend", None), attention.TritonPagedAttention)):
            return None
        from prefixserve.platforms.cuda.graphs import DecodeGraphs
        return DecodeGraphs(model, kv_caches, max_batch, max_blocks)

    def kernel_report(self) -> dict[str, dict[str, object]]:
        why = triton_missing()
        return {"triton": {"active": why is None, "reason": why or "Triton kernels: attention, pointwise"}}


register_platform(CudaPlatform())
