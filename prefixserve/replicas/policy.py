"""Which replica gets a request: the routing decision, with no Ray in it.

prefix-aware: the replica holding the longest cached prefix of the request's block-hash chain,
unless its load exceeds the least loaded replica's by both `balance_abs` and `balance_rel`
times (then the least loaded: reason "balance"); misses and ties go to the least loaded.
Loads are requests in flight. The same object routes in the Ray Serve router and in the
replaying simulator, so a simulated decision is the decision the service makes.

With a KV store the replicas share (same store, same key scope), a replica's cost for a request
is: the blocks its pool holds (free), then the blocks the store holds past them (a load), then
the rest (a recompute). The store is the same for every replica, so it never changes which
replica is cheapest; it only makes leaving the pool holder cheaper: when the store holds all
the holder would reuse, moving the request costs loads, not a recompute, and the smaller
`store_balance_abs` / `store_balance_rel` margins apply (reason "store_balance"). A request
no pool holds but the store does goes to the least loaded replica as a "store_hit".

A request with a routing key (OpenAI's prompt_cache_key, namespaced by its tenant) goes by that
key first, to the key's home (reason "cache_key"), unless the home's load exceeds the least
loaded replica's by both balance margins (then the least loaded, reason "balance", as for a
prefix hit). A key's home is decided when the key is first seen, by consistent hashing with
bounded loads: the first replica, in the key's rendezvous order (replicas by the hash of key and
replica, highest first), homing fewer than its even share of the known keys (rounded up), so
a few keys never pile onto one pool as plain hashing would let them. It then stays, so
adding a replica moves no key and losing one moves only the keys homed there. Requests of one
key share a pool even before any of them is cached.
"""
from __future__ import annotations

import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import xxhash

from prefixserve.kv.hashing import BlockHash, ImageSpan
from prefixserve.replicas.index import BlockIndex, ReplicaKey

ROUTERS = ("prefix-aware", "round-robin", "least-loaded")
PREFIX_HIT = "prefix_hit"
BALANCE = "balance"
MISS = "miss"
ROUND_ROBIN = "round_robin"
LEAST_LOADED = "least_loaded"
STORE_HIT = "store_hit"
STORE_BALANCE = "store_balance"
CACHE_KEY = "cache_key"
REASONS = (PREFIX_HIT, BALANCE, MISS, ROUND_ROBIN, LEAST_LOADED, STORE_HIT, STORE_BALANCE, CACHE_KEY)


@dataclass(frozen=True)
class RoutingConfig:
    router: str = "prefix-aware"
    # Both margins must be exceeded before load beats a cached prefix: an absolute one so that
    # 1 vs 3 requests in flight never counts as imbalance, a relative one so that 100 vs 103 does not.
    balance_abs: int = 8
    balance_rel: float = 1.5
    index_capacity: int = 1_000_000   # block hashes the router remembers, over all replicas
    key_capacity: int = 100_000       # routing keys whose home the router remembers (LRU)
    # A request's blocks count as held by the replica it was sent to for this long, or until
    # that replica's KV events confirm them.
    expect_ttl_s: float = 10.0
    # The margins when the shared store holds the holder's whole prefix: moving then costs a
    # load instead of a recompute, so load may win sooner (never later: each <= its pool twin).
    # None: 2 and 1.25, or the pool margin where that is smaller.
    store_balance_abs: Optional[int] = None
    store_balance_rel: Optional[float] = None

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {self.router!r}")
        if isinstance(self.balance_abs, bool) or not isinstance(self.balance_abs, int) \
                or self.balance_abs < 0:
            raise ValueError(f"balance_abs must be an int >= 0, got {self.balance_abs!r}")
        if isinstance(self.balance_rel, bool) or not isinstance(self.balance_rel, (int, float)) \
                or not self.balance_rel >= 1.0 or self.balance_rel == float("inf"):
            raise ValueError(f"balance_rel must be a finite number >= 1, got {self.balance_rel!r}")
        if self.store_balance_abs is None:
            object.__setattr__(self, "store_balance_abs", min(2, self.balance_abs))
        if self.store_balance_rel is None:
            object.__setattr__(self, "store_balance_rel", min(1.25, self.balance_rel))
        if isinstance(self.store_balance_abs, bool) or not isinstance(self.store_balance_abs, int) \
                or not 0 <= self.store_balance_abs <= self.balance_abs:
            raise ValueError(f"store_balance_abs must be an int in [0, balance_abs], "
                             f"got {self.store_balance_abs!r}")
        if isinstance(self.store_balance_rel, bool) \
                or not isinstance(self.store_balance_rel, (int, float)) \
                or not 1.0 <= self.store_balance_rel <= self.balance_rel:
            raise ValueError(f"store_balance_rel must be a number in [1, balance_rel], "
                             f"got {self.store_balance_rel!r}")
        if isinstance(self.index_capacity, bool) or not isinstance(self.index_capacity, int) \
                or self.index_capacity < 1:
            raise ValueError(f"index_capacity must be a positive int, got {self.index_capacity!r}")
        if isinstance(self.key_capacity, bool) or not isinstance(self.key_capacity, int) \
                or self.key_capacity < 1:
            raise ValueError(f"key_capacity must be a positive int, got {self.key_capacity!r}")
        if isinstance(self.expect_ttl_s, bool) or not isinstance(self.expect_ttl_s, (int, float)) \
                or not 0 <= self.expect_ttl_s < float("inf"):
            raise ValueError(f"expect_ttl_s must be a finite number >= 0, got {self.expect_ttl_s!r}")


@dataclass(frozen=True)
class Decision:
    replica: ReplicaKey
    reason: str
    matched_blocks: int   # blocks of the request the chosen replica holds, as far as the index knows
    store_blocks: int = 0  # blocks past those that the shared store holds (loaded, not computed)


class RoutingPolicy:
    def __init__(self, config: RoutingConfig = RoutingConfig(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.index = BlockIndex(config.index_capacity)
        self._turn = 0   # round-robin cursor, also breaks ties between equally loaded replicas
        self._homes: OrderedDict[str, ReplicaKey] = OrderedDict()   # routing key -> its home
        self._homed: Counter = Counter()                              # replica -> keys homed there

    def choose(self, replicas: Sequence[ReplicaKey], loads: Mapping[ReplicaKey, int],
               chain: Sequence[BlockHash], store_depth: int = 0,
               routing_key: Optional[str] = None) -> Decision:
        """store_depth: leading blocks of chain the replicas' shared KV store holds (0: none,
        or no shared store). routing_key: the request's namespaced prompt_cache_key, routed by
        first under prefix-aware routing."""
        if not replicas:
            raise ValueError("no replica to route to")
        if not 0 <= store_depth <= len(chain):
            raise ValueError(f"store_depth must be in [0, {len(chain)}], got {store_depth!r}")
        cfg = self.config
        if cfg.router == "round-robin":
            replica = replicas[self._turn % len(replicas)]
            self._turn += 1
            return _decide(replica, ROUND_ROBIN, self._depth(replica, chain), store_depth)
        least = self._least_loaded(replicas, loads)
        if cfg.router == "least-loaded":
            return _decide(least, LEAST_LOADED, self._depth(least, chain), store_depth)
        if routing_key is not None:
            decision = self._keyed(replicas, loads, chain, least, store_depth, routing_key)
        else:
            decision = self._prefix_aware(replicas, loads, chain, least, store_depth)
        if chain and cfg.expect_ttl_s > 0:
            self.index.expect(decision.replica, chain, self.clock() + cfg.expect_ttl_s)
        return decision

    def _prefix_aware(self, replicas: Sequence[ReplicaKey], loads: Mapping[ReplicaKey, int],
                      chain: Sequence[BlockHash], least: ReplicaKey,
                      store_depth: int) -> Decision:
        cfg = self.config
        depths = self.index.longest_prefix(chain) if chain else {}
        live = set(replicas)
        depths = {r: d for r, d in depths.items() if r in live}
        if not depths:
            return _decide(least, STORE_HIT if store_depth else MISS, 0, store_depth)
        best_depth = max(depths.values())
        best = self._least_loaded([r for r in replicas if depths.get(r) == best_depth], loads)
        best_load, min_load = loads.get(best, 0), loads.get(least, 0)
        # Leaving the holder recomputes nothing when the store holds all it would reuse.
        moving_is_a_load = store_depth >= best_depth
        margin_abs = cfg.store_balance_abs if moving_is_a_load else cfg.balance_abs
        margin_rel = cfg.store_balance_rel if moving_is_a_load else cfg.balance_rel
        if best_load - min_load > margin_abs and best_load > margin_rel * min_load:
            reason = STORE_BALANCE if moving_is_a_load else BALANCE
            return _decide(least, reason, depths.get(least, 0), store_depth)
        return _decide(best, PREFIX_HIT, best_depth, store_depth)

    def _keyed(self, replicas: Sequence[ReplicaKey], loads: Mapping[ReplicaKey, int],
               chain: Sequence[BlockHash], least: ReplicaKey, store_depth: int,
               key: str) -> Decision:
        home = self._home(replicas, key)
        cfg = self.config
        home_load, min_load = loads.get(home, 0), loads.get(least, 0)
        if home_load - min_load > cfg.balance_abs and home_load > cfg.balance_rel * min_load:
            return _decide(least, BALANCE, self._depth(least, chain), store_depth)
        return _decide(home, CACHE_KEY, self._depth(home, chain), store_depth)

    def _home(self, replicas: Sequence[ReplicaKey], key: str) -> ReplicaKey:
        homes, homed = self._homes, self._homed
        home = homes.get(key)
        if home is not None and home in replicas:
            homes.move_to_end(key)
            return home
        if home is not None:
            homed[home] -= 1   # its home is gone: the key is placed again
        encoded = key.encode("utf-8")
        ranked = sorted(replicas, reverse=True, key=lambda r: (
            xxhash.xxh3_64_intdigest(encoded + b"\0" + str(r).encode("utf-8")), str(r)))
        known = sum(homed[r] for r in replicas) + 1
        share = -(-known // len(replicas))
        home = next(r for r in ranked if homed[r] < share)
        homes[key] = home
        homed[home] += 1
        if len(homes) > self.config.key_capacity:
            _, old = homes.popitem(last=False)
            homed[old] -= 1
        return home

    def _least_loaded(self, candidates: Sequence[ReplicaKey],
                      loads: Mapping[ReplicaKey, int]) -> ReplicaKey:
        low = min(loads.get(r, 0) for r in candidates)
        tied = [r for r in candidates if loads.get(r, 0) == low]
        if len(tied) > 1:
            # Equally busy: the one caching least, so new prefixes spread over the pools
            # instead of piling up (and evicting each other) on one.
            least_held = min(self.index.num_held(r) for r in tied)
            tied = [r for r in tied if self.index.num_held(r) == least_held]
        choice = tied[self._turn % len(tied)]
        self._turn += 1
        return choice

    def _depth(self, replica: ReplicaKey, chain: Sequence[BlockHash]) -> int:
        return self.index.longest_prefix(chain).get(replica, 0) if chain else 0


def _decide(replica: ReplicaKey, reason: str, pool_depth: int, store_depth: int) -> Decision:
    return Decision(replica, reason, pool_depth, max(0, store_depth - pool_depth))


def routing_chain(hasher, token_ids: Sequence[int], block_size: int,
                  cache_salt: Optional[str], image_spans: Sequence[ImageSpan] = ()) -> list[BlockHash]:
    """The request's block-hash chain as its engine computes it: full blocks, salt in block 0, each
    block an image overlaps keyed by the image's content hash (token_ids expanded, image_spans as the
    engine's: multimodal/prompt.py). The engine never looks up the block holding the last prompt
    token, so neither do we."""
    usable = (len(token_ids) - 1) // block_size * block_size if token_ids else 0
    # an image past the last hashed block keys nothing; one cut by it keys the blocks it overlaps
    return hasher.hash_prompt(list(token_ids[:usable]), block_size, cache_salt=cache_salt,
                              image_spans=image_spans)
