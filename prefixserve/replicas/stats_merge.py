"""The front's EngineStats: the sum of what each replica last published (dataclasses.asdict of
its own EngineStats, so nested TenantStats arrive as dicts)."""
from __future__ import annotations

from dataclasses import fields

from prefixserve.engine.outputs import EngineStats, TenantStats

_TENANT_COUNTS = tuple(f.name for f in fields(TenantStats) if f.name != "tenant")


def sum_replica_stats(per_replica: list[dict], previous: EngineStats) -> EngineStats:
    """Counters summed across replicas; per-tenant seats and TenantStats summed tenant by tenant
    (every replica serves every tenant, so one replica's figures alone undercount); anything else
    (dtype, kernels, stores) is the first replica's."""
    if not per_replica:
        return previous
    merged: dict = {}
    for f in fields(EngineStats):
        values = [s[f.name] for s in per_replica if f.name in s]
        if not values:
            continue
        if f.name == "seats_by_tenant":
            merged[f.name] = _sum_by_key(values)
        elif f.name == "tenants":
            merged[f.name] = _sum_tenants(values)
        elif all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            merged[f.name] = sum(values)
        else:
            merged[f.name] = values[0]
    return EngineStats(**merged)


def _sum_by_key(dicts: list[dict]) -> dict:
    total: dict = {}
    for d in dicts:
        for key, n in d.items():
            total[key] = total.get(key, 0) + n
    return total


def _sum_tenants(per_replica: list[list[dict]]) -> tuple[TenantStats, ...]:
    counts: dict[str, dict[str, int]] = {}
    for tenants in per_replica:
        for row in tenants:
            into = counts.setdefault(row["tenant"], dict.fromkeys(_TENANT_COUNTS, 0))
            for name in _TENANT_COUNTS:
                into[name] += row[name]
    return tuple(TenantStats(tenant=name, **c) for name, c in counts.items())
