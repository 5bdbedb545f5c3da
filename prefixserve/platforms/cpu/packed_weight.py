"""Projection weights re-laid once, at load, for the packed GEMM (`native/packed_gemm.c`): the CPU
platform's weight preparation.

A model's projections (q/k/v, o, gate/up, down, the LM head) are packed in place where the CPU runs
the kernel in the model's dtype (bfloat16 with avx512_bf16, float32 with AVX-512): the row-major
parameter is replaced by a `PackedWeight` holding the same values in the kernel's panel layout, one
copy, never both. Where the LM head is tied to the embedding, the
embedding lookup reads its rows out of the packed panels (`PreparedWeight.rows`), so the tied matrix is not kept
twice either. Whoever needs the matrix itself (exporting a checkpoint) gets `unpacked()`, a copy.
"""
from __future__ import annotations

import torch
from torch import nn

from prefixserve.model.huge_pages import zeros_on_huge_pages
from prefixserve.model.prepared_weight import PreparedWeight
from prefixserve.platforms.cpu.native import packed_gemm


class PackedWeight(PreparedWeight):
    """A bfloat16 or float32 weight [out_features, in_features] in panels of `packed_gemm.PANEL` output
    columns (`packed_gemm.panel_shape`)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        if not applies(weight):
            raise ValueError(f"cannot pack a {weight.dtype} weight of shape {tuple(weight.shape)} on "
                             f"{weight.device}: 2-D on the CPU, in a dtype the kernel runs here "
                             f"({', '.join(map(str, _dtypes()))}), bfloat16 rows of an even length")
        self.out_features, self.in_features = weight.shape
        panels = zeros_on_huge_pages(packed_gemm.panel_shape(self.out_features, self.in_features, weight.dtype),
                                     dtype=weight.dtype, device=weight.device)
        self.panels = nn.Parameter(packed_gemm.pack(weight.detach(), panels), requires_grad=False)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def dtype(self) -> torch.dtype:
        return self.panels.dtype

    @property
    def device(self) -> torch.device:
        return self.panels.device

    def extra_repr(self) -> str:
        return f"out_features={self.out_features}, in_features={self.in_features}, dtype={self.dtype}"

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None, widened: bool = False) -> torch.Tensor:
        """x [..., in] @ W.T (+ bias), like F.linear; `widened`: its float32 `.float()`, stored so at once."""
        kernel = packed_gemm.default_kernel()
        if kernel is None:
            raise RuntimeError("packed weights need the packed_gemm kernel, which this process cannot load")
        if bias is not None:
            if bias.shape != (self.out_features,):
                raise ValueError(f"bias {tuple(bias.shape)} for {self.out_features} columns")
            bias = bias.float().contiguous()
        if x.dim() == 2:
            return kernel.product(x.contiguous(), self.panels, self.out_features, bias, widened)
        flat = x.reshape(-1, self.in_features).contiguous()
        return kernel.product(flat, self.panels, self.out_features, bias, widened).view(*x.shape[:-1],
                                                                                        self.out_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """W[ids] (an embedding lookup), gathered out of the panels."""
        ids = ids.reshape(-1)
        picked = self.panels[ids // packed_gemm.PANEL, :, ids % packed_gemm.PANEL, :]
        return picked.reshape(ids.numel(), self.in_features)

    def unpacked(self) -> torch.Tensor:
        """The row-major matrix, a new tensor."""
        flat = self.panels.permute(0, 2, 1, 3).reshape(-1, self.in_features)
        return flat[:self.out_features].clone()


def _dtypes() -> tuple[torch.dtype, ...]:
    kernel = packed_gemm.default_kernel()
    return () if kernel is None else kernel.dtypes


def applies(weight: torch.Tensor | PackedWeight) -> bool:
    """Whether `weight` can be packed: a row-major tensor the kernel takes, on a CPU that runs it."""
    return (isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.device.type == "cpu"
            and weight.dtype in _dtypes() and weight.shape[1] % packed_gemm.STEP[weight.dtype] == 0)


def pack_attribute(module: nn.Module, name: str) -> PackedWeight:
    """Replaces the parameter `module.name` by its packed form, dropping the row-major one."""
    packed = PackedWeight(getattr(module, name))
    delattr(module, name)
    setattr(module, name, packed)
    return packed

