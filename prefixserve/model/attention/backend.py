"""The one seam between the models and the kernels that read the paged KV pool.

A model computes q/k/v for the flat batch and hands them to a backend; the
backend writes k/v into the pool and returns attention outputs. A CUDA backend
(flash-attn's paged kernels, a Triton kernel) implements this same method and
registers a name in BACKENDS; no model code changes.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch

from prefixserve.model.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Writes k/v into their slots, then attends causally within each sequence.

        q [T, H, D], k and v [T, KVH, D] (rows packed as meta describes; may be strided
        views), kv_cache [2, num_blocks, block_size, KVH, D]. Returns [T, H, D], contiguous.
        """


def _torch_backend() -> AttentionBackend:
    from prefixserve.model.attention.torch_paged import TorchPagedAttention
    return TorchPagedAttention()


# name -> factory; factories import lazily so a missing GPU library breaks only its backend.
BACKENDS: dict[str, Callable[[], AttentionBackend]] = {"torch": _torch_backend}


def get_attention_backend(name: str = "torch") -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is not one of {sorted(BACKENDS)}")
    return BACKENDS[name]()
