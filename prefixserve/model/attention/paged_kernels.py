"""A platform's kernels for the torch attention backend: what torch_paged.py calls them through.

The backend holds the kernels themselves (one for decode tokens, one for prefill chunks, a writer into
the pool), each None where the platform has none or they do not load; a `PagedKernels` is the platform's
knowledge of how to drive them (their tables, their layouts, the call). Without one, or where a kernel
does not take the operands, the backend runs its torch paths (gathers and SDPA), so every device reads
the pool. `platform.Platform.paged_attention_kernels()` hands it to the backend.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Protocol

import torch

from prefixserve.model.attention.cascade import DecodePlan
from prefixserve.model.attention.metadata import AttentionMetadata


class PagedKernel(Protocol):
    def supports(self, q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether the kernel takes these queries over this pool (device, dtype, shapes)."""


class PagedDecodeKernel(PagedKernel, Protocol):
    # keys of one softmax tile: a shared run's state carries on into a sequence's own blocks at its edge
    tile_keys: int


class PagedKernels(ABC):
    """How a platform loads and drives its paged-attention kernels."""

    @abstractmethod
    def load(self) -> tuple[PagedDecodeKernel | None, PagedKernel | None, Any]:
        """(decode kernel, prefill kernel, pool writer), each None where it cannot be used here."""

    @abstractmethod
    def reads(self, decode: Any, prefill: Any, layout: str, dtype: torch.dtype) -> bool:
        """Whether the decode and prefill kernels both read a pool of `dtype` laid out in `layout`."""

    @abstractmethod
    def write(self, writer: Any, kv_cache: torch.Tensor, layout: str, slots: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> bool:
        """Writes the step's K/V into their slots where the writer takes them; False: the caller writes."""

    @abstractmethod
    def prefill(self, kernel: Any, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, out: torch.Tensor, scratch: Callable[[int], torch.Tensor]) -> bool:
        """Every chunk of more than one query token of the step into its rows of out, K/V read from the pool;
        False where the kernel does not take them (out untouched)."""

    @abstractmethod
    def decode_tables(self, kernel: Any, plan: DecodePlan) -> Any:
        """The decode plan's tables as the kernel takes them, built once per step for every layer; None where
        the kernel cannot read them (the backend gathers)."""

    @abstractmethod
    def decode(self, kernel: Any, queries: torch.Tensor, kv_cache: torch.Tensor, layout: str, plan: DecodePlan,
               tables: Any, scale: float) -> torch.Tensor:
        """Single-token float32 queries [N, KVH, G, D] over their contexts: [N, KVH, G, D]."""
