"""The one seam between the models and the kernels that read the paged KV pool.

A model computes q/k/v for the flat batch and hands them to a backend; the
backend writes k/v into the pool and returns attention outputs. Once per step,
before the forward, the runner lets the backend turn the step's generic
`AttentionMetadata` into whatever plan its kernels need (`build_metadata`);
every layer then passes that object back to `forward`. Backends make
themselves known through `registry.register_backend`; no model code names one.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from prefixserve.model.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    name: str

    def build_metadata(self, common: AttentionMetadata) -> Any:
        """The per-step object `forward` receives, built once per step from the generic metadata.

        Backends that need nothing beyond the generic fields return it unchanged.
        """
        return common

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: Any, scale: float) -> torch.Tensor:
        """Writes k/v into their slots, then attends causally within each sequence.

        q [T, H, D], k and v [T, KVH, D] (rows packed as the metadata describes; may be
        strided views), kv_cache [2, num_blocks, block_size, KVH, D], meta what
        `build_metadata` returned for this step. Returns [T, H, D], contiguous.
        """
