"""Routing without Ray: KV events, the bounded block index, the routing decision and the
replaying simulator, each against a brute-force oracle or an invariant of the engine."""
import random

import pytest

from prefixserve.errors import PinLimitError
from prefixserve.kv import BlockHasher, KVCacheConfig, KVCacheManager
from prefixserve.kv.events import KVEvent, KVEventBatch, KVEventLog
from prefixserve.replicas.index import BlockIndex
from prefixserve.replicas.policy import (BALANCE, MISS, PREFIX_HIT, RoutingConfig, RoutingPolicy,
                                         routing_chain)
from prefixserve.replicas.simulator import SimRequest, simulate, tenant_requests
from routing_oracle import oracle_hits

BS = 4


def manager(num_blocks=24, **kw):
    return KVCacheManager(KVCacheConfig(num_blocks=num_blocks, block_size=BS, **kw))


def admit(kv, rid, tokens, salt=None):
    hit = kv.find_cached_prefix(rid, tokens, cache_salt=salt)
    alloc = kv.allocate_slots(rid, tokens, hit.num_tokens, len(tokens) - hit.num_tokens, hit=hit,
                              cache_salt=salt)
    return hit, alloc


def test_events_replayed_equal_what_the_pool_holds():
    """Random admissions, frees, pins, evictions and resets: the set rebuilt from the events
    alone always equals the pool's own index."""
    rng = random.Random(1)
    kv = manager(num_blocks=12, max_pinned_blocks=6)
    log = KVEventLog()
    kv.watch(log)
    index = BlockIndex()
    live = []
    for step in range(600):
        op = rng.random()
        if op < 0.55:
            rid = f"r{step}"
            tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 14))]
            if kv.num_blocks_needed(rid, len(tokens)) <= kv.stats().num_free_blocks + \
                    kv.stats().num_cached_free_blocks:
                _, alloc = admit(kv, rid, tokens, salt=rng.choice([None, "a", "b"]))
                if alloc is not None:
                    live.append(rid)
        elif op < 0.85 and live:
            kv.free(live.pop(rng.randrange(len(live))))
        elif op < 0.95:
            try:
                kv.pin_prefix([rng.randrange(3) for _ in range(8)], ttl_s=5.0)
            except PinLimitError:
                pass   # the pinned-block cap (6): the pool and the events stay as they were
        else:
            kv.reset_prefix_cache()
        assert index.apply("x", log.drain())
        assert {h for h in kv.cached_hashes()} == {h for h in kv.cached_hashes()
                                                  if index.holds("x", h)}
        assert index.num_held("x") == len(kv.cached_hashes())


def test_event_log_overflow_asks_for_a_snapshot():
    kv = manager(num_blocks=24)
    log = KVEventLog(capacity=3)
    kv.watch(log)
    admit(kv, "a", list(range(4 * BS + 1)))
    batch = log.drain()
    assert batch.overflowed and batch.events == ()
    index = BlockIndex()
    assert not index.apply("x", batch)
    index.rebuild("x", kv.cached_hashes())
    assert index.num_held("x") == 4
    assert not log.drain().overflowed   # a drain starts the log afresh


def brute_depths(truth, chain):
    out = {}
    for r, held in truth.items():
        d = 0
        while d < len(chain) and chain[d] in held:
            d += 1
        if d:
            out[r] = d
    return out


def test_index_matches_brute_force_and_stays_bounded():
    rng = random.Random(7)
    hashes = [bytes([i]) for i in range(40)]
    unbounded, bounded = BlockIndex(), BlockIndex(capacity=10)
    truth = {r: set() for r in "abc"}
    for _ in range(2000):
        r = rng.choice("abc")
        op = rng.random()
        hs = rng.sample(hashes, rng.randrange(1, 5))
        if op < 0.5:
            for ix in (unbounded, bounded):
                ix.add(r, hs)
            truth[r] |= set(hs)
        elif op < 0.9:
            for ix in (unbounded, bounded):
                ix.remove(r, hs)
            truth[r] -= set(hs)
        else:
            for ix in (unbounded, bounded):
                ix.forget(r)
            truth[r] = set()
        chain = rng.sample(hashes, 6)
        assert unbounded.longest_prefix(chain) == brute_depths(truth, chain)
        assert len(bounded) <= 10
        # Bounded: never claims a block the replica does not hold, never a longer prefix.
        for rep, depth in bounded.longest_prefix(chain).items():
            assert depth <= brute_depths(truth, chain).get(rep, 0)
        for rep in "abc":
            assert all(h in truth[rep] for h in hashes if bounded.holds(rep, h))


def test_prefix_aware_decision_matches_the_rule():
    """Every decision checked against the rule written out by brute force."""
    rng = random.Random(3)
    cfg = RoutingConfig(balance_abs=2, balance_rel=1.5, expect_ttl_s=0)
    policy = RoutingPolicy(cfg)
    replicas = ["a", "b", "c"]
    hashes = [bytes([i]) for i in range(12)]
    truth = {r: set() for r in replicas}
    for _ in range(1500):
        r = rng.choice(replicas)
        hs = hashes[:rng.randrange(0, 12)]
        policy.index.rebuild(r, hs)
        truth[r] = set(hs)
        loads = {x: rng.randrange(0, 8) for x in replicas}
        chain = hashes[:rng.randrange(0, 12)]
        d = policy.choose(replicas, loads, chain)
        depths = brute_depths(truth, chain)
        low = min(loads.values())
        if not depths:
            assert (d.reason, loads[d.replica]) == (MISS, low)
            continue
        top = max(depths.values())
        best_load = min(loads[x] for x in depths if depths[x] == top)
        if best_load - low > 2 and best_load > 1.5 * low:
            assert (d.reason, loads[d.replica]) == (BALANCE, low)
        else:
            assert d.reason == PREFIX_HIT and depths.get(d.replica) == top
            assert loads[d.replica] == best_load


def test_a_routed_prefix_counts_as_held_until_confirmed_or_expired():
    """Requests of one tenant arriving together follow the first before its replica reports
    the blocks; unconfirmed expectations expire, confirmed ones stay."""
    now = [0.0]
    policy = RoutingPolicy(RoutingConfig(expect_ttl_s=5.0), clock=lambda: now[0])
    chain_a, chain_b = [b"a1", b"a2"], [b"b1", b"b2"]
    first = policy.choose(["x", "y"], {"x": 0, "y": 0}, chain_a)
    assert first.reason == MISS
    loads = {first.replica: 1, ("y" if first.replica == "x" else "x"): 0}
    again = policy.choose(["x", "y"], loads, chain_a)
    assert (again.replica, again.reason) == (first.replica, PREFIX_HIT)
    other = policy.choose(["x", "y"], {"x": 0, "y": 0}, chain_b)
    # The replica confirms chain_a's first block only.
    policy.index.apply(first.replica, KVEventBatch((KVEvent("stored", (b"a1",)),)))
    now[0] = 6.0
    policy.index.expire(now[0])
    assert policy.index.longest_prefix(chain_a) == {first.replica: 1}
    assert policy.index.longest_prefix(chain_b) == {}
    assert other.reason in (MISS, PREFIX_HIT)


def test_routing_config_is_validated():
    for bad in ({"router": "random"}, {"balance_abs": -1}, {"balance_rel": 0.5},
                {"balance_rel": float("nan")}, {"index_capacity": 0}, {"balance_abs": True},
                {"expect_ttl_s": -1}, {"expect_ttl_s": float("inf")}):
        with pytest.raises(ValueError):
            RoutingConfig(**bad)


def test_salted_chains_never_match_each_other():
    hasher = BlockHasher("xxh3_64", "m")
    tokens = list(range(40))
    policy = RoutingPolicy()
    policy.index.add("a", routing_chain(hasher, tokens, BS, "tenant-a"))
    assert policy.index.longest_prefix(routing_chain(hasher, tokens, BS, "tenant-b")) == {}
    assert policy.index.longest_prefix(routing_chain(hasher, tokens, BS, None)) == {}
    assert policy.index.longest_prefix(routing_chain(hasher, tokens, BS, "tenant-a")) == {"a": 9}


def test_simulator_single_pool_equals_the_oracle():
    reqs = tenant_requests(5, 6, 3 * BS + 2, 5, vocab=50, seed=2)
    res = simulate(reqs, num_replicas=1, blocks_per_replica=10_000, block_size=BS, concurrency=3)
    assert res.hit_tokens == oracle_hits(reqs, [0] * len(reqs), BS)
    assert res.prompt_tokens == sum(len(r.token_ids) for r in reqs)


def test_round_robin_simulation_equals_the_oracle_and_prefix_aware_beats_it():
    reqs = tenant_requests(6, 8, 5 * BS, 3, vocab=50, seed=4)
    rr = simulate(reqs, num_replicas=3, blocks_per_replica=10_000, block_size=BS,
                  config=RoutingConfig(router="round-robin"))
    assert rr.hit_tokens == oracle_hits(reqs, [i % 3 for i in range(len(reqs))], BS)
    pa = simulate(reqs, num_replicas=3, blocks_per_replica=10_000, block_size=BS,
                  config=RoutingConfig(balance_abs=100))
    # With no balancing, each tenant's requests stay on the replica of its first one: every
    # request after a tenant's first hits the whole system prompt.
    assert pa.hit_tokens == 6 * 7 * 5 * BS
    assert pa.hit_tokens > rr.hit_tokens


def test_simulator_refuses_a_request_larger_than_a_pool():
    with pytest.raises(ValueError):
        simulate([SimRequest(tuple(range(50)))], num_replicas=1, blocks_per_replica=4,
                 block_size=BS)


def test_engine_events_carry_the_routers_hashes():
    """The router's chain for a salted prompt, computed with the replicas' hasher, is exactly
    what the engine reports holding after serving it."""
    from prefixserve import LLM, SamplingParams
    llm = LLM("random:qwen3-tiny", block_size=8, num_kv_blocks=64)
    engine = llm.engine
    assert engine.kv_events().overflowed          # nothing watched before a snapshot
    assert engine.kv_snapshot() == []
    prompt = list(range(10, 10 + 8 * 5 + 3))
    llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-1"},
                 SamplingParams(max_tokens=1, temperature=0.0))
    batch = engine.kv_events()
    stored = [h for e in batch.events if e.kind == "stored" for h in e.hashes]
    hasher = BlockHasher(engine.config.hash_algo, engine.info.model_identity)
    chain = routing_chain(hasher, prompt, 8, "tenant-1")
    assert len(chain) == 5 and stored[:5] == chain
    assert set(chain) <= set(engine.kv_snapshot())
    assert routing_chain(hasher, prompt, 8, "tenant-2")[0] not in set(engine.kv_snapshot())
    engine.reset_prefix_cache()
    assert [e.kind for e in engine.kv_events().events] == ["cleared"]
    assert isinstance(engine.kv_events(), KVEventBatch)


def follow(hub, cursor, index):
    """What the router does with a poll (router.py's loop without Ray)."""
    cursor, changes = hub.poll(cursor)
    assert index.follow(changes)
    return cursor


def test_hub_followers_see_what_every_replica_holds():
    """Two replicas' real KV events through a hub with a tiny log: a follower polling often,
    one polling rarely (resyncs) and one starting late all end with each pool's own index."""
    from prefixserve.replicas.hub import KVEventHub
    rng = random.Random(5)
    hub = KVEventHub(log_capacity=3)
    kvs = {name: manager(num_blocks=10) for name in ("r1", "r2")}
    logs = {name: KVEventLog() for name in kvs}
    for name, kv in kvs.items():
        kv.watch(logs[name])
        assert hub.publish(name, snapshot=kv.cached_hashes())
    often, rarely = BlockIndex(), BlockIndex()
    c_often = c_rarely = -1
    live = {name: [] for name in kvs}
    for step in range(300):
        name = rng.choice(list(kvs))
        kv = kvs[name]
        if rng.random() < 0.6:
            rid = f"q{step}"
            tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 13))]
            _, alloc = admit(kv, rid, tokens)
            if alloc is not None:
                live[name].append(rid)
            else:
                kv.free(rid)
        elif live[name]:
            kv.free(live[name].pop(0))
        if not hub.publish(name, batch=logs[name].drain()):
            hub.publish(name, snapshot=kv.cached_hashes())
        c_often = follow(hub, c_often, often)
        if step % 17 == 0:
            c_rarely = follow(hub, c_rarely, rarely)
    follow(hub, c_rarely, rarely)
    late = BlockIndex()
    follow(hub, -1, late)
    for index in (often, rarely, late):
        for name, kv in kvs.items():
            assert sorted(index.held(name)) == sorted(kv.cached_hashes())
    hub.gone("r1")
    follow(hub, c_often, often)
    assert often.held("r1") == [] and "r1" not in hub.stats()


def test_serve_flags_of_the_replicated_service():
    """`serve --replicas` flags reach the configs; one engine stays in-process and bad values
    are refused before anything starts."""
    from prefixserve.entrypoints.cli import build_parser
    from prefixserve.entrypoints.serve_replicas import wants_replicas
    from prefixserve.replicas.service import ReplicaConfig
    parse = build_parser().parse_args
    assert not wants_replicas(parse(["serve"]))
    assert wants_replicas(parse(["serve", "--ray-address", "auto"]))
    args = parse(["serve", "--replicas", "3", "--router", "round-robin", "--balance-abs", "2",
                  "--balance-rel", "2.5", "--router-index-capacity", "100"])
    assert wants_replicas(args)
    assert RoutingConfig(router=args.router, balance_abs=args.balance_abs,
                         balance_rel=args.balance_rel, index_capacity=args.router_index_capacity) \
        == RoutingConfig("round-robin", 2, 2.5, 100)
    with pytest.raises(ValueError):
        wants_replicas(parse(["serve", "--replicas", "0"]))
    with pytest.raises(SystemExit):
        parse(["serve", "--router", "random"])
    for bad in ({"num_replicas": 0}, {"replica_cpus": 0}, {"app_name": "a b"},
                {"max_ongoing_requests": 0}, {"routing": "prefix-aware"}):
        with pytest.raises(ValueError):
            ReplicaConfig(**bad)


def test_one_replica_one_at_a_time_equals_the_diagnose_replay_with_evictions():
    """With a pool too small for every tenant, one replica serving one request at a time hits
    exactly what `prefixserve replay` (diagnose/replay.py) computes for the same log."""
    from prefixserve.diagnose.replay import ReplayConfig, ReplayRequest, replay
    reqs = tenant_requests(6, 5, 6 * BS, 3, vocab=50, seed=9)
    pool = 20   # three tenants' prefixes at most
    sim = simulate(reqs, num_replicas=1, blocks_per_replica=pool, block_size=BS, concurrency=1)
    ref = replay([ReplayRequest(f"r{i}", r.token_ids, r.cache_salt) for i, r in enumerate(reqs)],
                 ReplayConfig(num_blocks=pool, block_size=BS))
    assert ref.evictions > 0
    assert (sim.prompt_tokens, sim.hit_tokens) == (ref.prompt_tokens, ref.hit_tokens)


def test_a_logged_request_log_replays_over_replicas(tmp_path, capsys):
    """`sim_report --log`: a JSON Lines log rendered by the model's chat template; each tenant
    stays on one replica, so every request after a tenant's first hits what it shares with
    the earlier ones (the oracle, on one unbounded pool per tenant)."""
    import json

    from prefixserve.benchmarks.routing_sim import load_log, main
    systems = {"acme": "You are acme's assistant. Answer about invoices and refunds. " * 3,
               "zeta": "You are zeta's assistant. Answer about rockets and fuel. " * 3}
    order = ["acme", "acme", "zeta", "zeta", "acme", "zeta", "zeta", "acme"]
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps({"tenant": t, "body": {"model": "m", "messages": [
        {"role": "system", "content": systems[t]}, {"role": "user", "content": f"question {i}"}]}})
        + "\n" for i, t in enumerate(order)))
    reqs = load_log(str(path), "random:qwen3-tiny")
    assert [r.cache_salt for r in reqs] == order
    res = simulate(reqs, num_replicas=2, blocks_per_replica=10_000, block_size=BS,
                   config=RoutingConfig(balance_abs=100))
    first_replica = {}
    assignment = [first_replica.setdefault(r.cache_salt, len(first_replica)) for r in reqs]
    assert res.hit_tokens == oracle_hits(reqs, assignment, BS) > 0
    assert main(["--log", str(path), "--replicas", "2", "--block-size", str(BS)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    # header, one pool, three routers, two with a store, one with prompt_cache_key
    assert len(rows) == 1 + 1 + 3 + 2 + 1
