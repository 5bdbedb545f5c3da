"""dtype="auto" made concrete before engines are built, for engines that must agree on it.

Each engine resolves auto itself (its platform's choose_dtype; the CPU's measures once a process). Engines in several
processes, a replica service's replicas, would each time bfloat16 for themselves; whoever starts
them resolves it once here and hands every one the same concrete dtype.
"""
from __future__ import annotations

import dataclasses

import torch

from prefixserve.engine.config import EngineConfig
from prefixserve.model.platform import DtypeChoice, platform_for


def with_concrete_dtype(config: EngineConfig) -> tuple[EngineConfig, DtypeChoice]:
    """`config` with dtype="auto" replaced by what auto picks on this machine, and that choice; an explicit
    dtype, or auto off the CPU (each engine's checkpoint dtype), left as it is."""
    device = torch.device(config.device)
    choice = platform_for(device).choose_dtype(config.dtype, device)
    if choice.dtype is None:
        return config, choice
    return dataclasses.replace(config, dtype=choice.dtype), choice
