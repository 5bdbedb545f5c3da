"""Cache shares (kv/tenant_shares.py) against a brute-force model of the floors.

The model knows only the rule: the pool's free-cached blocks in their eviction order (the order
the plain policy would evict them in) and who each is charged to; a miss of tenant X takes free
blocks first, then, one at a time, the first block in that order that X may evict: its own, one
of a tenant holding more cached blocks than its floor, or, while X's allowance (its share minus
what it held when the allocation began) lasts, any other. Every allocation the manager makes
must evict exactly the model's blocks, in its order, and refuse exactly when the model finds too
few; check_integrity audits the charges after every operation.
"""
from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings, strategies as st

from prefixserve.kv import KVCacheConfig, KVCacheManager

BS = 4


def model_victims(kv: KVCacheManager, tenant, needed: int, hit_ids: list[int]):
    """The blocks the rule evicts for `needed` new blocks of tenant's (None: too few)."""
    pool = kv._pool
    blocks = pool.blocks
    floors = pool.shares.shares if pool.shares is not None else {}
    order = [b for b in kv.eviction_order() if b not in set(hit_ids)]
    counts = Counter(blocks[b].owner for b in order)
    take_free = min(needed, pool.num_free)
    allowance = max(0, floors.get(tenant, 0) - pool.held.get(tenant, 0)) if floors else 0
    victims = []
    for _ in range(needed - take_free):
        for b in order:
            owner = blocks[b].owner
            floor = floors.get(owner, 0) if floors and owner is not None else 0
            if owner == tenant or counts[owner] > floor or not floors:
                break
            if allowance > 0:
                allowance -= 1
                break
        else:
            return None
        order.remove(b)
        counts[owner] -= 1
        victims.append(b)
    return victims


def manager(num_blocks: int, weights: dict, shares: bool = True) -> KVCacheManager:
    kv = KVCacheManager(KVCacheConfig(num_blocks=num_blocks, block_size=BS, tenant_weights=weights,
                                      tenant_cache_shares=shares))
    kv.enable_store_journal(write_through=False)   # its eviction journal names the victims
    return kv


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 100_000), num_blocks=st.integers(8, 60), n_tenants=st.integers(2, 4),
       weights=st.lists(st.sampled_from([1, 2, 3]), min_size=4, max_size=4),
       steps=st.integers(10, 80), shares=st.booleans())
def test_evictions_follow_the_floors_exactly(seed, num_blocks, n_tenants, weights, steps, shares):
    rng = random.Random(seed)
    names = [f"t{i}" for i in range(n_tenants)]
    kv = manager(num_blocks, {t: float(weights[i]) for i, t in enumerate(names)}, shares)
    tenants = names + [None]          # None: a tenant the weights do not name (no floor)
    prompts = {t: [] for t in tenants}
    live: dict[str, tuple] = {}
    for step in range(steps):
        if live and rng.random() < 0.4:
            rid = rng.choice(sorted(live))
            del live[rid]
            kv.free(rid)
        else:
            tenant = rng.choice(tenants)
            if prompts[tenant] and rng.random() < 0.4:
                prompt = rng.choice(prompts[tenant])   # a repeat: hits its own cached blocks
            else:
                prompt = [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 6 * BS))]
                prompts[tenant].append(prompt)
            salt = "anon" if tenant is None else tenant
            rid = f"r{step}"
            hit = kv.find_cached_prefix(rid, prompt, cache_salt=salt)
            needed = -(-len(prompt) // BS) - len(hit.block_ids)
            expected = model_victims(kv, tenant, needed, hit.block_ids)
            before = {t: kv._pool.shares.queued(t) for t in tenants} if kv._pool.shares is not None else {}
            held_before = kv._pool.held.get(tenant, 0)
            kv.take_evicted()
            alloc = kv.allocate_slots(rid, prompt, hit.num_tokens, len(prompt) - hit.num_tokens, hit=hit,
                                      cache_salt=salt, tenant=tenant)
            assert (alloc is None) == (expected is None)
            if alloc is not None:
                live[rid] = (tenant, prompt)
                assert [b for b, _ in kv.take_evicted()] == expected
                shares_ = kv._pool.shares
                if shares_ is not None and held_before >= shares_.floor(tenant):
                    for other in tenants:
                        if other != tenant:   # over its share, tenant reached below no floor
                            assert shares_.queued(other) >= min(before[other], shares_.floor(other))
        kv.check_integrity()
    for rid in list(live):
        kv.free(rid)
    kv.check_integrity()
    assert kv.stats().num_used_blocks == 0


def test_merged_queues_evict_in_the_order_of_the_single_queue():
    """Floors that never bite (every tenant holds less than its floor is never reached by an
    eviction: a pool of plenty) leave the order exactly as one LRU queue orders it."""
    rng = random.Random(3)
    split = manager(400, {"a": 1.0, "b": 1.0}, shares=True)
    single = manager(400, {"a": 1.0, "b": 1.0}, shares=False)
    for i in range(40):
        tenant = rng.choice("ab")
        prompt = [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 5 * BS))]
        for kv in (split, single):
            kv.allocate_slots(f"r{i}", prompt, 0, len(prompt), cache_salt=tenant, tenant=tenant)
            if i % 3 == 0:
                kv.free(f"r{i - 3}") if i >= 3 else None
        assert split.eviction_order() == single.eviction_order()


def test_a_quiet_tenants_cached_prompt_survives_a_flood_of_another():
    """quiet caches a 10-block system prompt; flood then streams distinct prompts through a
    48-block pool. With shares the quiet prompt is still there (its floor is 24 blocks); without
    them, the global LRU has evicted it."""
    system = list(range(1, 41))
    for shares, survives in ((True, True), (False, False)):
        kv = manager(48, {"quiet": 1.0, "flood": 1.0}, shares)
        kv.allocate_slots("q", system + [7], 0, 41, cache_salt="quiet", tenant="quiet")
        kv.free("q")
        for i in range(30):
            prompt = [1000 + i * 50 + j for j in range(40)]
            assert kv.allocate_slots(f"f{i}", prompt, 0, 40, cache_salt="flood", tenant="flood") is not None
            kv.free(f"f{i}")
            kv.check_integrity()
        hit = kv.find_cached_prefix("q2", system + [8], cache_salt="quiet")
        assert (hit.num_tokens == 40) == survives
        evicted = kv.stats().evictions_by_tenant
        assert evicted.get("quiet", 0) == (0 if survives else 10)
        assert evicted["flood"] > 0


def test_a_tenant_under_its_share_may_reach_into_anothers_floor():
    """b fills the pool's cache alone (above its floor); a, holding nothing, may take up to its
    share of blocks from b's, floors or not, and no more once it holds its share."""
    kv = manager(16, {"a": 1.0, "b": 1.0})
    for i in range(4):
        kv.allocate_slots(f"b{i}", list(range(i * 16 + 1, i * 16 + 17)), 0, 16, cache_salt="b", tenant="b")
        kv.free(f"b{i}")
    assert kv._pool.shares.queued("b") == 16
    assert kv.allocate_slots("a0", [5] * 32, 0, 32, cache_salt="a", tenant="a") is not None   # 8 blocks
    assert kv.allocate_slots("a1", [6] * 4, 0, 4, cache_salt="a", tenant="a") is None   # b is at its floor
    kv.free("a0")
    assert kv.allocate_slots("a1", [6] * 4, 0, 4, cache_salt="a", tenant="a") is not None   # its own blocks
    kv.check_integrity()
