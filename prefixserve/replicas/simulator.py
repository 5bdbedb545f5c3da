"""Replays a request log through the router and each replica's KV bookkeeping, with no model.

Each simulated replica is the engine's own `KVCacheManager` reporting KV events, and the router
is the service's `RoutingPolicy` fed by those events, so a simulated hit is a hit the service
would make with the same arrival order. Requests arrive one at a time and `concurrency` of
them are in flight at once (the oldest finishes when a new one arrives); a request in flight
holds its blocks and counts toward its replica's load.

With `shared_store`, the replicas share an unbounded KV store written through: every full block
a replica computes lands in it, and a replica loads from it the blocks past its pool hit that
the store holds (then holds them, as the engine does). The router sees the store's depth.
"""
from __future__ import annotations

import random
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

from prefixserve.kv import KVCacheConfig, KVCacheManager
from prefixserve.kv.events import KVEventLog
from prefixserve.replicas.policy import RoutingConfig, RoutingPolicy, routing_chain


@dataclass(frozen=True)
class SimRequest:
    token_ids: tuple[int, ...]
    cache_salt: Optional[str] = None
    routing_key: Optional[str] = None   # a namespaced prompt_cache_key (policy.py)


@dataclass
class SimResult:
    router: str
    num_replicas: int
    blocks_per_replica: int
    prompt_tokens: int = 0
    hit_tokens: int = 0
    store_tokens: int = 0   # prompt tokens loaded from the shared store (past the pool hit)
    requests_per_replica: list[int] = field(default_factory=list)
    computed_per_replica: list[int] = field(default_factory=list)
    reasons: Counter = field(default_factory=Counter)

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.hit_tokens - self.store_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def max_load_ratio(self) -> float:
        """Requests of the busiest replica over the mean per replica."""
        mean = sum(self.requests_per_replica) / len(self.requests_per_replica)
        return max(self.requests_per_replica) / mean if mean else 0.0


def tenant_requests(num_tenants: int, requests_per_tenant: int, system_tokens: int,
                    question_tokens: int, vocab: int = 4000, seed: int = 0) -> list[SimRequest]:
    """The `tenants` log: each tenant its own system prompt and salt, questions interleaved
    at random across tenants."""
    rng = random.Random(seed)
    systems = [tuple(rng.randrange(vocab) for _ in range(system_tokens)) for _ in range(num_tenants)]
    order = [t for t in range(num_tenants) for _ in range(requests_per_tenant)]
    rng.shuffle(order)
    return [SimRequest(systems[t] + tuple(rng.randrange(vocab) for _ in range(question_tokens)),
                       f"tenant-{t}") for t in order]


def simulate(requests: Sequence[SimRequest], *, num_replicas: int, blocks_per_replica: int,
             block_size: int = 16, config: RoutingConfig = RoutingConfig(), concurrency: int = 8,
             hash_algo: str = "xxh3_64", model_identity: str = "simulated",
             shared_store: bool = False) -> SimResult:
    if num_replicas < 1 or blocks_per_replica < 1 or concurrency < 1:
        raise ValueError("num_replicas, blocks_per_replica and concurrency must be >= 1")
    kv_config = KVCacheConfig(num_blocks=blocks_per_replica, block_size=block_size,
                              enable_prefix_caching=True, hash_algo=hash_algo,
                              eviction_policy="lru", model_identity=model_identity)
    managers = [KVCacheManager(kv_config) for _ in range(num_replicas)]
    logs = [KVEventLog() for _ in range(num_replicas)]
    for manager, log in zip(managers, logs):
        manager.watch(log)
    policy = RoutingPolicy(config)
    hasher = managers[0].hasher
    names = list(range(num_replicas))
    loads = [0] * num_replicas
    in_flight: deque[tuple[int, str]] = deque()
    stored: set = set()
    result = SimResult(config.router, num_replicas, blocks_per_replica,
                       requests_per_replica=[0] * num_replicas,
                       computed_per_replica=[0] * num_replicas)

    def finish_oldest() -> None:
        replica, rid = in_flight.popleft()
        managers[replica].free(rid)
        loads[replica] -= 1

    for n, req in enumerate(requests):
        while len(in_flight) >= concurrency:
            finish_oldest()
        tokens = list(req.token_ids)
        chain = routing_chain(hasher, tokens, block_size, req.cache_salt)
        store_depth = 0
        if shared_store:
            while store_depth < len(chain) and chain[store_depth] in stored:
                store_depth += 1
        decision = policy.choose(names, dict(enumerate(loads)), chain, store_depth=store_depth,
                                 routing_key=req.routing_key)
        replica = decision.replica
        manager, rid = managers[replica], f"r{n}"
        hit = manager.find_cached_prefix(rid, tokens, cache_salt=req.cache_salt)
        alloc = manager.allocate_slots(rid, tokens, hit.num_tokens, len(tokens) - hit.num_tokens,
                                       hit=hit, cache_salt=req.cache_salt)
        while alloc is None and any(r == replica for r, _ in in_flight):
            # The pool is full of requests in flight: the engine would queue this one until one
            # ends; the simulation ends the oldest on this replica.
            oldest = next(i for i, (r, _) in enumerate(in_flight) if r == replica)
            in_flight.rotate(-oldest)
            finish_oldest()
            in_flight.rotate(oldest)
            hit = manager.find_cached_prefix(rid, tokens, cache_salt=req.cache_salt)
            alloc = manager.allocate_slots(rid, tokens, hit.num_tokens,
                                           len(tokens) - hit.num_tokens, hit=hit,
                                           cache_salt=req.cache_salt)
        if alloc is None:
            raise ValueError(f"a {len(tokens)}-token request does not fit in "
                             f"{blocks_per_replica} blocks of {block_size}")
        in_flight.append((replica, rid))
        loads[replica] += 1
        result.prompt_tokens += len(tokens)
        result.hit_tokens += hit.num_tokens
        loaded = max(0, store_depth * block_size - hit.num_tokens)
        result.store_tokens += loaded
        result.requests_per_replica[replica] += 1
        result.computed_per_replica[replica] += len(tokens) - hit.num_tokens - loaded
        if shared_store:
            stored.update(hasher.hash_prompt(tokens[:len(tokens) // block_size * block_size],
                                             block_size, cache_salt=req.cache_salt))
        result.reasons[decision.reason] += 1
        for i, log in enumerate(logs):
            if not policy.index.apply(i, log.drain()):
                policy.index.rebuild(i, managers[i].cached_hashes())
                log.restart()
    while in_flight:
        finish_oldest()
    return result
