"""Tenants as the scheduler sees them: a name and a weight, never a key.

Each tenant has a virtual token counter (VTC, Sheng et al., "Fairness in Serving Large Language
Models", OSDI 2024): the prompt and output tokens it has been served, divided by its weight. The
fair step serves tenants in counter order, so over time each gets tokens in proportion to its
weight. A tenant that comes back after idling is lifted to the lowest counter among the tenants
that have work, so its idle time buys it no credit to starve the others with later.
"""
from __future__ import annotations

from typing import Mapping, Optional

DEFAULT_WEIGHT = 1.0
# Counters of idle tenants are forgotten beyond this many tenants; one coming back is lifted
# to the active minimum anyway, which is where a forgotten counter starts.
_MAX_IDLE_COUNTERS = 4096


def tenant_share(total: int, weights: Mapping[str, float], tenant: Optional[str]) -> Optional[int]:
    """tenant's weighted share of total (at least 1), or None where it has no share of its own:
    a tenant not in weights (the anonymous one, without a keys file) may use all of total."""
    if tenant is None or tenant not in weights:
        return None
    return max(1, int(total * weights[tenant] / sum(weights.values())))


class TenantLedger:
    """Weights, virtual token counters and which tenants have unfinished requests."""

    def __init__(self, weights: Mapping[str, float]) -> None:
        self.weights = dict(weights)
        self.counters: dict[Optional[str], float] = {}
        # Unfinished requests (waiting or running) per tenant; a tenant with none is absent.
        self.load: dict[Optional[str], int] = {}
        # Per weighted (named) tenant, for metrics: tokens served (unweighted), and the prompt
        # tokens of its admitted requests and how many of them the prefix cache held.
        self.served: dict[str, int] = {name: 0 for name in self.weights}
        self.prompt_tokens: dict[str, int] = {name: 0 for name in self.weights}
        self.cached_tokens: dict[str, int] = {name: 0 for name in self.weights}

    def weight(self, tenant: Optional[str]) -> float:
        return self.weights.get(tenant, DEFAULT_WEIGHT) if tenant is not None else DEFAULT_WEIGHT

    def arrived(self, tenant: Optional[str]) -> None:
        """One more unfinished request of tenant; lifts an idle tenant to the active minimum."""
        count = self.load.get(tenant, 0)
        if count == 0:
            active = [self.counters.get(t, 0.0) for t in self.load]
            if active:
                self.counters[tenant] = max(self.counters.get(tenant, 0.0), min(active))
            if len(self.counters) > _MAX_IDLE_COUNTERS:
                self.counters = {t: c for t, c in self.counters.items() if t in self.load or t == tenant}
        self.load[tenant] = count + 1

    def left(self, tenant: Optional[str]) -> None:
        count = self.load.get(tenant, 0) - 1
        if count > 0:
            self.load[tenant] = count
        else:
            self.load.pop(tenant, None)

    def charge(self, tenant: Optional[str], tokens: int) -> None:
        """tenant was served tokens (negative: a rolled-back step gives them back)."""
        self.counters[tenant] = self.counters.get(tenant, 0.0) + tokens / self.weight(tenant)
        if tenant in self.served:
            self.served[tenant] += tokens

    def admitted(self, tenant: Optional[str], prompt_tokens: int, cached_tokens: int) -> None:
        if tenant in self.prompt_tokens:
            self.prompt_tokens[tenant] += prompt_tokens
            self.cached_tokens[tenant] += cached_tokens

    def counter(self, tenant: Optional[str]) -> float:
        return self.counters.get(tenant, 0.0)

    @property
    def num_active(self) -> int:
        return len(self.load)
