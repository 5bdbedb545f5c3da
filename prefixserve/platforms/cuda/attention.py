"""The "triton" attention backend: the step's K/V written into the pool, then every chunk of more than one
query token in one prefill launch and every decode token in the split / shared-run / combine launches
(paged_attention.py), all reading K/V straight from the pool in rows.

It is the one "auto" picks on CUDA. On the CPU it runs the same kernels under Triton's interpreter, only
when asked for by name (`attention_backend="triton"`): slow, it exists so the kernels and the whole
engine over them are held to the torch backend and to HF transformers without a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from prefixserve.model.attention.backend import AttentionBackend
from prefixserve.model.attention.metadata import AttentionMetadata
from prefixserve.model.attention.registry import register_backend
from prefixserve.model.kv_layout import ROWS, write_kv
from prefixserve.platforms.cuda.triton_runtime import prepare


@dataclass
class StepPlan:
    """The step's generic metadata and the kernels' plan of it, built by the first layer."""
    common: AttentionMetadata
    plan: Any = None


# above the torch backend's 0: "auto" prefers it where it may be picked automatically (CUDA)
RANK = 10


@register_backend("triton", devices=("cuda", "cpu"), dtypes=(torch.float32, torch.bfloat16, torch.float16),
                  rank=RANK, auto_devices=("cuda",))
class TritonPagedAttention(AttentionBackend):
    def __init__(self, device: torch.device | str = "cuda", num_splits: int | None = None) -> None:
        """num_splits: how many splits every decode context is cut into (tests); None: enough to fill the
        device."""
        # imported here, not at module level: the package imports where Triton is absent, and Triton's mode
        # (compiled or interpreted) is settled for the device first
        prepare(torch.device(device).type)
        from prefixserve.platforms.cuda import paged_attention
        self._kernels = paged_attention
        self.num_splits = num_splits

    def build_metadata(self, common: AttentionMetadata) -> StepPlan:
        return StepPlan(common)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                step: StepPlan, scale: float) -> torch.Tensor:
        meta = step.common
        write_kv(kv_cache, ROWS, meta.slot_mapping, k, v)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = q.new_empty(q.shape)
        kernels = self._kernels
        tiles = kernels.tiles_for(q.device, q.shape[-1], q.dtype)
        if step.plan is None:
            # tile and split sizes follow the model's heads, first seen here; every later layer reuses them
            num_kv_heads = kv_cache.shape[3]
            step.plan = kernels.plan_step(meta, num_kv_heads, q.shape[1] // num_kv_heads, tiles, self.num_splits)
        plan = step.plan
        if plan.prefill is not None:
            kernels.prefill(q, kv_cache, plan.prefill, scale, out, tiles)
        if plan.decode is not None:
            kernels.decode(q, kv_cache, plan.decode, scale, out, tiles)
        return out
