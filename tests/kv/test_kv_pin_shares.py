"""Each tenant's share of the pinned blocks: one tenant can never hold more than its share, so
it can never take all of the pinned part of the pool and have every other tenant's pins
refused. Oracle: the distinct blocks of each tenant's live pins, recomputed from scratch after
every step of random pin / unpin / expiry sequences."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixserve.kv import KVCacheConfig, KVCacheManager, PinLimitError
from prefixserve.kv.pins import PinRegistry

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def manager(num_blocks=64, cap=None, per_tenant=None):
    clock = Clock()
    kv = KVCacheManager(KVCacheConfig(num_blocks=num_blocks, block_size=BS, max_pinned_blocks=cap,
                                      max_pinned_blocks_per_tenant=per_tenant), clock=clock)
    return kv, clock


def cached(kv, tokens, salt):
    """tokens, cached under salt, and the blocks that hold them"""
    kv.allocate_slots("fill", tokens, 0, len(tokens), cache_salt=salt)
    table = list(kv.block_table("fill"))
    kv.free("fill")
    return tokens, table


def test_a_tenant_past_its_share_is_refused_and_the_others_still_pin():
    kv, _ = manager(cap=5, per_tenant=3)
    acme, _ = cached(kv, list(range(16)), "acme")            # 4 blocks
    zeta, _ = cached(kv, list(range(100, 116)), "zeta")
    first = kv.pin_prefix(acme, cache_salt="acme", num_tokens=8, tenant="acme")
    # a longer prefix of the same prompt adds one block, its first two count once
    assert kv.pin_prefix(acme, cache_salt="acme", num_tokens=12, tenant="acme").num_tokens == 12
    with pytest.raises(PinLimitError) as refused:
        kv.pin_prefix(acme, cache_salt="acme", tenant="acme")     # 4 blocks > 3
    assert refused.value.code == "tenant_pin_limit"
    assert kv.pin_prefix(zeta, cache_salt="zeta", num_tokens=8, tenant="zeta").num_tokens == 8
    with pytest.raises(PinLimitError) as full:                   # 6 > the cap of all pins
        kv.pin_prefix(zeta, cache_salt="zeta", num_tokens=12, tenant="zeta")
    assert full.value.code == "pin_limit"
    # refreshing a pin the tenant holds charges nothing new
    assert kv.pin_prefix(acme, cache_salt="acme", num_tokens=8, ttl_s=5, tenant="acme").pin_id == first.pin_id
    assert kv.unpin(first.pin_id)
    kv.check_integrity()


def test_without_a_share_only_the_cap_of_all_pins_applies():
    kv, _ = manager(cap=4)
    acme, _ = cached(kv, list(range(16)), "acme")
    assert kv.pin_prefix(acme, cache_salt="acme", tenant="acme").num_tokens == 16


def live_blocks_by_tenant(pins: dict) -> dict:
    by_tenant: dict = {}
    for blocks, tenant in pins.values():
        by_tenant.setdefault(tenant, set()).update(blocks)
    return by_tenant


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), cap=st.integers(0, 12), per_tenant=st.integers(0, 8))
def test_random_pin_sequences_keep_every_tenant_within_its_share(seed, cap, per_tenant):
    rng = random.Random(seed)
    kv, clock = manager(num_blocks=48, cap=cap, per_tenant=per_tenant)
    tenants = ["acme", "zeta", None]
    # 5 blocks each
    prompts = {t: cached(kv, [(31 * k + i) % 997 for i in range(20)], t) for k, t in enumerate(tenants)}
    live: dict = {}        # pin id -> (blocks, tenant that placed it), with its expiry alongside
    expiry: dict = {}
    for _ in range(60):
        op = rng.random()
        if op < 0.6:
            tenant = rng.choice(tenants)
            n = rng.randint(1, 20)
            ttl = rng.choice([None, 1.0, 3.0])
            before = live_blocks_by_tenant(live)
            tokens, table = prompts[tenant]
            blocks = set(table[:n // BS])
            try:
                info = kv.pin_prefix(tokens, cache_salt=tenant, num_tokens=n, ttl_s=ttl, tenant=tenant)
            except PinLimitError:
                union = set().union(*before.values()) if before else set()
                assert len(union | blocks) > cap or len(before.get(tenant, set()) | blocks) > per_tenant
                continue
            assert set(info.block_ids) == blocks
            if info.pin_id is not None and info.pin_id not in live:
                union = set().union(*before.values()) if before else set()
                assert len(union | set(info.block_ids)) <= cap
                assert len(before.get(tenant, set()) | set(info.block_ids)) <= per_tenant
                live[info.pin_id] = (set(info.block_ids), tenant)
            if info.pin_id is not None:
                expiry[info.pin_id] = info.expires_at
        elif op < 0.8 and live:
            pin_id = rng.choice(sorted(live))
            assert kv.unpin(pin_id)
            del live[pin_id]
        else:
            clock.now += rng.choice([0.5, 2.0])
            kv.expire_pins()
            for pin_id in [p for p in live if expiry[p] is not None and expiry[p] <= clock.now]:
                del live[pin_id]
        assert {p.pin_id for p in kv.pins()} == set(live)
        by_tenant = live_blocks_by_tenant(live)
        assert kv.stats().num_pinned_blocks == len(set().union(*by_tenant.values()) if by_tenant else set())
        for tenant in tenants:
            assert kv._pins.num_tenant_blocks(tenant) == len(by_tenant.get(tenant, set())) <= per_tenant
        kv.check_integrity()


def test_a_hot_pin_refreshed_many_times_keeps_its_expiry_queue_small_and_expires_on_time():
    reg = PinRegistry(None)
    info = reg.add((1, 2), 8, expires_at=10.0)
    for i in range(10_000):
        reg.refresh(info.pin_id, 10.0 + i)
    assert len(reg._expiry) <= 2 * len(reg._pins) + 65
    assert reg.pop_expired(10_008.5) == []           # the latest refresh, not an earlier one, counts
    assert reg.pop_expired(10_009.0) == [(1, 2)]
    assert not reg.infos()
