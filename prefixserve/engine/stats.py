"""The engine's counters in one snapshot (EngineStats), taken after every step by AsyncLLM and
read by /metrics, the health endpoint, admission (num_seats) and the replicas' router."""
from __future__ import annotations

from typing import Optional

from prefixserve.engine.kv_store_bridge import KVStoreBridge
from prefixserve.engine.outputs import EngineStats, TenantStats
from prefixserve.engine.sample_groups import SampleGroups
from prefixserve.kv import KVCacheManager
from prefixserve.scheduler import Scheduler
from prefixserve.worker.model_runner import ModelRunner


def engine_stats(scheduler: Scheduler, kv_manager: KVCacheManager, runner: ModelRunner,
                 groups: SampleGroups, *, weights_bytes: int, dtype: str,
                 kv_stores: Optional[KVStoreBridge], images_prepared: int = 0) -> EngineStats:
    s = scheduler.stats
    kv = kv_manager.stats()
    encoder = runner.encoder_cache
    return EngineStats(
        prompt_tokens=s.prompt_tokens,
        cached_prompt_tokens=s.cached_prompt_tokens,
        computed_prompt_tokens=s.computed_prompt_tokens,
        computed_tokens=s.computed_tokens,
        generated_tokens=s.generated_tokens,
        requests_finished=groups.requests_finished,
        num_running=scheduler.num_running,
        num_waiting=scheduler.num_waiting,
        preemptions=s.preemptions,
        steps=s.steps,
        blocks_total=kv.num_blocks,
        blocks_free=kv.num_free_blocks,
        blocks_cached=kv.num_cached_free_blocks,
        blocks_in_use=kv.num_used_blocks,
        blocks_pinned=kv.num_pinned_blocks,
        evictions=kv.evictions,
        cow_copies=kv.cow_copies,
        prefix_cache_queries=kv.query_tokens,
        prefix_cache_hits=kv.hit_tokens,
        kv_cache_bytes=runner.kv_cache_bytes,
        weights_bytes=weights_bytes,
        dtype=dtype,
        kernels_active={name: k["active"] for name, k in runner.kernels.items()},
        num_seats=groups.num_seats,
        kv_stores=tuple(kv_stores.stats()) if kv_stores is not None else (),
        encoder_runs=encoder.runs if encoder is not None else 0,
        encoder_cache_hits=encoder.hits if encoder is not None else 0,
        images_prepared=images_prepared,
        seats_by_tenant=groups.seats_by_tenant() if scheduler.tenants.weights else {},
        tenants=_tenant_stats(scheduler, kv.evictions_by_tenant),
    )


def _tenant_stats(scheduler: Scheduler, evictions: dict) -> tuple[TenantStats, ...]:
    ledger = scheduler.tenants
    if not ledger.weights:
        return ()
    waiting: dict = {}
    running: dict = {}
    for req in scheduler.waiting:
        waiting[req.tenant] = waiting.get(req.tenant, 0) + 1
    for req in scheduler.running:
        running[req.tenant] = running.get(req.tenant, 0) + 1
    return tuple(TenantStats(t, waiting.get(t, 0), running.get(t, 0), ledger.served[t],
                             ledger.prompt_tokens[t], ledger.cached_tokens[t], evictions.get(t, 0))
                 for t in ledger.weights)
