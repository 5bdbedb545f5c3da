"""The front's stats under --replicas: every replica's per-tenant figures count, not the first's."""
from __future__ import annotations

import dataclasses
import random

from prefixserve.engine import EngineStats
from prefixserve.engine.outputs import TenantStats
from prefixserve.replicas.stats_merge import sum_replica_stats

_COUNTS = ("num_waiting", "num_running", "tokens_served", "prompt_tokens", "cached_prompt_tokens", "evictions")


def _replica(rng: random.Random, tenants: list[str]) -> EngineStats:
    ints = {f.name: rng.randrange(100) for f in dataclasses.fields(EngineStats)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    return EngineStats(**ints, dtype="float32",
                       seats_by_tenant={t: rng.randrange(10) for t in tenants},
                       tenants=tuple(TenantStats(t, *(rng.randrange(1000) for _ in _COUNTS)) for t in tenants))


def test_per_tenant_fields_are_summed_across_replicas():
    rng = random.Random(5)
    replicas = [_replica(rng, ["acme", "zeta"]), _replica(rng, ["acme", "zeta"]), _replica(rng, ["zeta"])]
    # what a replica publishes through the hub: its stats as plain dicts
    merged = sum_replica_stats([dataclasses.asdict(r) for r in replicas], replicas[0])

    by_tenant = {t.tenant: t for t in merged.tenants}
    assert set(by_tenant) == {"acme", "zeta"}
    for name in ("acme", "zeta"):
        rows = [t for r in replicas for t in r.tenants if t.tenant == name]
        assert isinstance(by_tenant[name], TenantStats)
        for field in _COUNTS:
            assert getattr(by_tenant[name], field) == sum(getattr(t, field) for t in rows), (name, field)
        assert merged.seats_by_tenant[name] == sum(r.seats_by_tenant.get(name, 0) for r in replicas)
    assert merged.prompt_tokens == sum(r.prompt_tokens for r in replicas)
    assert merged.dtype == "float32"


def test_no_replica_yet_keeps_the_previous_stats():
    rng = random.Random(1)
    previous = _replica(rng, ["acme"])
    assert sum_replica_stats([], previous) is previous
