"""Limits that shape every scheduling step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from prefixserve.kv import check_weights

SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 4096
    policy: str = "fcfs"
    # Bound on queued requests; None = unbounded (the server sets one so overload
    # turns into 429s rather than memory growth).
    max_waiting: Optional[int] = None
    # (tenant, weight) pairs; a tenant not named here weighs 1 (scheduler/tenants.py).
    tenant_weights: tuple = ()
    # Share each step's token budget and the running slots across the tenants with work by
    # their weighted served-token counters; with one tenant it changes nothing.
    fair_scheduling: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}")
        if self.max_waiting is not None and (not isinstance(self.max_waiting, int) or self.max_waiting < 1):
            raise ValueError(f"max_waiting must be a positive integer or None, got {self.max_waiting!r}")
        object.__setattr__(self, "tenant_weights", check_weights(self.tenant_weights))
        if not isinstance(self.fair_scheduling, bool):
            raise ValueError(f"fair_scheduling must be a bool, got {self.fair_scheduling!r}")
