"""Routing by prompt_cache_key (policy.py): rendezvous hashing over the replicas, the balance
rule of prefix hits, tenants' keys kept apart, and the simulated hit rate against prefix-aware
routing without keys."""
import dataclasses
import random

import xxhash

from prefixserve.entrypoints.server.prompt_cache_fields import prompt_cache_fields
from prefixserve.replicas.policy import BALANCE, CACHE_KEY, RoutingConfig, RoutingPolicy
from prefixserve.replicas.simulator import simulate, tenant_requests


def ranked(key: str, replicas) -> list:
    """The key's rendezvous order: replicas by the hash of key and replica, highest first."""
    return sorted(replicas, reverse=True,
                  key=lambda r: xxhash.xxh3_64_intdigest(key.encode() + b"\0" + str(r).encode()))


def test_each_key_stays_on_one_replica_whatever_the_prompt():
    policy = RoutingPolicy(RoutingConfig())
    replicas = ["a", "b", "c"]
    rng = random.Random(0)
    seen = {}
    for i in range(120):
        key = f"k{rng.randrange(12)}"
        chain = [rng.randbytes(8) for _ in range(rng.randrange(0, 4))]
        decision = policy.choose(replicas, {}, chain, routing_key=key)
        assert decision.reason == CACHE_KEY
        assert seen.setdefault(key, decision.replica) == decision.replica


def test_keys_take_their_first_replica_in_hash_order_with_room():
    """The oracle replays bounded-load consistent hashing by brute force."""
    policy = RoutingPolicy(RoutingConfig())
    replicas = ["a", "b", "c", "d"]
    homed = {r: 0 for r in replicas}
    for i in range(50):
        key = f"tenant-{i}|key"
        share = -(-(sum(homed.values()) + 1) // len(replicas))
        expected = next(r for r in ranked(key, replicas) if homed[r] < share)
        homed[expected] += 1
        assert policy.choose(replicas, {}, [], routing_key=key).replica == expected
        assert max(homed.values()) - min(homed.values()) <= 1


def test_losing_a_replica_moves_only_the_keys_homed_there():
    policy = RoutingPolicy(RoutingConfig())
    keys = [f"key-{i}" for i in range(200)]
    before = {k: policy.choose(["a", "b", "c"], {}, [], routing_key=k).replica for k in keys}
    after = {k: policy.choose(["a", "c"], {}, [], routing_key=k).replica for k in keys}
    assert {k for k in keys if before[k] != after[k]} == {k for k in keys if before[k] == "b"}
    assert 0 < sum(r == "b" for r in before.values()) < len(keys)
    # a replica added later takes new keys only
    again = {k: policy.choose(["a", "c", "e"], {}, [], routing_key=k).replica for k in keys}
    assert again == after


def test_an_overloaded_home_gives_way_by_the_balance_rule():
    config = RoutingConfig(balance_abs=2, balance_rel=1.5)
    key = "hot"
    target = ranked(key, ["a", "b"])[0]
    other = "b" if target == "a" else "a"
    for home_load, other_load, expected in [(3, 0, other), (2, 0, target), (6, 4, target),
                                            (7, 4, other)]:
        policy = RoutingPolicy(config)
        decision = policy.choose(["a", "b"], {target: home_load, other: other_load}, [],
                                 routing_key=key)
        exceeds = home_load - other_load > 2 and home_load > 1.5 * other_load
        assert decision.replica == expected
        assert decision.reason == (BALANCE if exceeds else CACHE_KEY)


def test_the_same_key_of_two_tenants_is_two_keys():
    fields = prompt_cache_fields("support-bot")
    a, b = fields.routing_key("tenant-a"), fields.routing_key("tenant-b")
    assert a != b and fields.routing_key(None) not in (a, b)
    # no namespace can be spelt so that its key reads as another's
    assert prompt_cache_fields("x|y").routing_key("t") != prompt_cache_fields("y").routing_key("t|x")
    assert prompt_cache_fields(None).routing_key("t") is None


def test_keyed_routing_hits_at_least_as_well_as_prefix_aware_on_two_replicas():
    log = tenant_requests(num_tenants=12, requests_per_tenant=12, system_tokens=512,
                          question_tokens=48, seed=1)
    keyed = [dataclasses.replace(r, routing_key=f"{r.cache_salt}|agent") for r in log]
    common = dict(num_replicas=2, blocks_per_replica=256, block_size=16, concurrency=8)
    plain = simulate(log, **common)
    by_key = simulate(keyed, **common)
    assert by_key.hit_rate >= plain.hit_rate
    assert by_key.reasons[CACHE_KEY] + by_key.reasons[BALANCE] == len(log)
