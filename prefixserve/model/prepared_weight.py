"""A weight a platform re-laid at load for its own kernels, as the device-neutral code sees it.

A platform may replace a projection's row-major parameter by a prepared form (the CPU platform's packed
panels): one copy, never both. Whatever the form, the layers multiply by it (`matmul`), the embedding reads
its rows (`rows`), and whoever needs the matrix itself (exporting a checkpoint) gets `unpacked()`, a copy.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn


class PreparedWeight(nn.Module, ABC):
    """A weight [out_features, in_features] held in a platform's own layout."""

    @property
    @abstractmethod
    def shape(self) -> torch.Size:
        """(out_features, in_features), as the row-major matrix has it."""

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype:
        ...

    @abstractmethod
    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None, widened: bool = False) -> torch.Tensor:
        """x [..., in] @ W.T (+ bias), like F.linear; `widened`: its float32 `.float()`."""

    @abstractmethod
    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """W[ids] (an embedding lookup) as [len(ids), in_features]."""

    @abstractmethod
    def unpacked(self) -> torch.Tensor:
        """The row-major matrix, a new tensor."""


def matrix(weight: torch.Tensor | PreparedWeight) -> torch.Tensor:
    """The row-major matrix: the weight itself, or a prepared weight's unpacked copy."""
    return weight.unpacked() if isinstance(weight, PreparedWeight) else weight


def embedding(ids: torch.Tensor, weight: torch.Tensor | PreparedWeight) -> torch.Tensor:
    """F.embedding(ids, weight), for a row-major or a prepared weight."""
    if isinstance(weight, PreparedWeight):
        return weight.rows(ids).view(*ids.shape, weight.shape[1])
    return F.embedding(ids, weight)
