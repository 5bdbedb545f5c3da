"""Routing with a KV store the replicas share: every decision against a brute-force cost
oracle (pool blocks free, store blocks a load, the rest a recompute), no Ray."""
import random

import pytest

from prefixserve.replicas.policy import (BALANCE, MISS, PREFIX_HIT, STORE_BALANCE, STORE_HIT,
                                         RoutingConfig, RoutingPolicy)
from prefixserve.replicas.simulator import simulate, tenant_requests
from routing_oracle import oracle_hits

BS = 4
LOAD_COST, COMPUTE_COST = 1, 10   # any weights with COMPUTE_COST > LOAD_COST > 0 rank alike


def walk(held: set, chain: list) -> int:
    depth = 0
    while depth < len(chain) and chain[depth] in held:
        depth += 1
    return depth


def oracle(truth: dict, loads: dict, chain: list, store_depth: int, cfg: RoutingConfig):
    """(reasons allowed, replicas allowed) by costing every replica from scratch."""
    depth = {r: walk(held, chain) for r, held in truth.items()}
    compute = {r: len(chain) - max(d, store_depth) for r, d in depth.items()}
    cost = {r: COMPUTE_COST * compute[r] + LOAD_COST * max(0, store_depth - depth[r])
            for r in truth}
    low = min(loads.values())
    least = {r for r in truth if loads[r] == low}
    if not any(depth.values()):
        return (STORE_HIT if store_depth else MISS), least
    cheapest = min(cost.values())
    cheap = [r for r in truth if cost[r] == cheapest]
    best_load = min(loads[r] for r in cheap)
    best = {r for r in cheap if loads[r] == best_load}
    # Leaving the holder for the least loaded replica recomputes nothing when the store covers it.
    moving_is_free = all(compute[r] == compute[next(iter(best))] for r in least)
    if moving_is_free:
        margin_abs, margin_rel, reason = cfg.store_balance_abs, cfg.store_balance_rel, STORE_BALANCE
    else:
        margin_abs, margin_rel, reason = cfg.balance_abs, cfg.balance_rel, BALANCE
    if best_load - low > margin_abs and best_load > margin_rel * low:
        return reason, least
    return PREFIX_HIT, best


def test_store_costs_match_the_brute_force_oracle():
    rng = random.Random(16)
    cfg = RoutingConfig(balance_abs=4, balance_rel=1.5, store_balance_abs=1,
                        store_balance_rel=1.2, expect_ttl_s=0)
    policy = RoutingPolicy(cfg)
    pool_only = RoutingPolicy(cfg)
    replicas = ["a", "b", "c", "d"]
    # Two prompts' chains, so that some requests find no pool holding their first block.
    families = [[bytes([f, i]) for i in range(10)] for f in range(2)]
    truth = {r: set() for r in replicas}
    seen = set()
    for _ in range(3000):
        r = rng.choice(replicas)
        held = set(rng.choice(families)[:rng.randrange(0, 10)])
        policy.index.rebuild(r, held)
        pool_only.index.rebuild(r, held)
        truth[r] = held
        loads = {x: rng.randrange(0, 10) for x in replicas}
        chain = rng.choice(families)[:rng.randrange(0, 10)]
        store_depth = rng.randrange(0, len(chain) + 1)
        d = policy.choose(replicas, loads, chain, store_depth=store_depth)
        reason, allowed = oracle(truth, loads, chain, store_depth, cfg)
        assert d.reason == reason and d.replica in allowed, (loads, store_depth, truth, d)
        depth = walk(truth[d.replica], chain)
        assert (d.matched_blocks, d.store_blocks) == (depth, max(0, store_depth - depth))
        # The shared store never reorders the replicas: without a move, the store-less
        # policy picks a replica of the same depth and load.
        plain = pool_only.choose(replicas, loads, chain)
        if reason == PREFIX_HIT and plain.reason == PREFIX_HIT:
            assert (walk(truth[plain.replica], chain), loads[plain.replica]) \
                == (depth, loads[d.replica])
        seen.add(reason)
    assert seen == {PREFIX_HIT, BALANCE, MISS, STORE_HIT, STORE_BALANCE}


def test_the_store_only_relaxes_the_balance_rule():
    """Holder at 5 in flight, the other idle: the pool margins keep the request on the holder,
    the store margins move it once the store holds the whole prefix, not before."""
    cfg = RoutingConfig(balance_abs=8, balance_rel=1.5, store_balance_abs=2,
                        store_balance_rel=1.25, expect_ttl_s=0)
    policy = RoutingPolicy(cfg)
    chain = [b"p0", b"p1", b"p2", b"p3"]
    policy.index.rebuild("holder", chain)
    loads = {"holder": 5, "idle": 0}
    assert policy.choose(["holder", "idle"], loads, chain).reason == PREFIX_HIT
    assert policy.choose(["holder", "idle"], loads, chain, store_depth=3).reason == PREFIX_HIT
    moved = policy.choose(["holder", "idle"], loads, chain, store_depth=4)
    assert (moved.replica, moved.reason, moved.matched_blocks, moved.store_blocks) \
        == ("idle", STORE_BALANCE, 0, 4)
    first = policy.choose(["holder", "idle"], loads, [b"q0", b"q1"], store_depth=2)
    assert (first.replica, first.reason, first.store_blocks) == ("idle", STORE_HIT, 2)


def test_store_margins_are_validated():
    assert RoutingConfig(balance_abs=1, balance_rel=1.1).store_balance_abs == 1
    assert RoutingConfig(balance_abs=1, balance_rel=1.1).store_balance_rel == 1.1
    for bad in ({"store_balance_abs": 9}, {"store_balance_abs": -1},
                {"store_balance_abs": True}, {"store_balance_rel": 0.9},
                {"store_balance_rel": 2.0}, {"store_balance_rel": float("nan")}):
        with pytest.raises(ValueError):
            RoutingConfig(**bad)
    with pytest.raises(ValueError):
        RoutingPolicy(RoutingConfig()).choose(["a"], {"a": 0}, [b"x"], store_depth=2)


def test_with_a_shared_store_every_block_is_computed_once_whatever_the_routing():
    """An unbounded store written through holds every block any replica computed, so over
    small, evicting pools and any router, the reused tokens are those of one unbounded pool."""
    reqs = tenant_requests(6, 8, 5 * BS, 3, vocab=50, seed=5)
    once = oracle_hits(reqs, [0] * len(reqs), BS)
    for router in ("round-robin", "least-loaded", "prefix-aware"):
        res = simulate(reqs, num_replicas=3, blocks_per_replica=16, block_size=BS,
                       concurrency=4, config=RoutingConfig(router=router), shared_store=True)
        assert res.hit_tokens + res.store_tokens == once, router
        assert res.computed_tokens == res.prompt_tokens - once
    plain = simulate(reqs, num_replicas=3, blocks_per_replica=16, block_size=BS, concurrency=4,
                     config=RoutingConfig(router="round-robin"))
    assert plain.store_tokens == 0 and plain.hit_tokens < once


def test_serve_passes_kv_store_urls_to_the_replicas_engine_config():
    """`serve --replicas N --kv-store URL`: the one EngineConfig every replica is built from
    carries the store URLs, in order (the service test shows both replicas opening them)."""
    from prefixserve.entrypoints.cli import build_parser
    from prefixserve.entrypoints.engine_args import engine_config_from_args
    from prefixserve.entrypoints.serve_replicas import wants_replicas
    args = build_parser().parse_args(["serve", "--replicas", "2", "--kv-store", "mem://?size=1MiB",
                                      "--kv-store", "redis://127.0.0.1:6390/0"])
    assert wants_replicas(args)
    config = engine_config_from_args(args, max_waiting=None)
    assert config.kv_stores == ("mem://?size=1MiB", "redis://127.0.0.1:6390/0")
