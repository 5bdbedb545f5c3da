"""The Ray Serve request router of the engine replicas.

Plugged into Ray Serve through its request-router interface (the deployment's
`RequestRouterConfig`), so it runs inside every process that holds a handle to the replicas.
For `generate` calls it hashes the request's token ids with the replicas' hasher and salt (and a
prompt's image spans, which the front computed: the router runs no image code) and asks the
RoutingPolicy; calls that name `target_replica` (reset, identify) go to that replica
only. Loads are the requests this router has in flight on each replica. The index follows the
hub's KV events; a replica that Ray Serve reports dead or removed is forgotten at once.
With a KV store every replica shares (Redis), the router asks it, in one batched call per
request, how many leading blocks of the chain it holds: a load from there costs less than a
recompute, so the balance rule may move such a request off a busy pool holder.
"""
from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter
from typing import Optional

import ray
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from prefixserve.kv.hashing import BlockHasher
from prefixserve.kv.stores import KVStore, StoreError, open_store
from prefixserve.kv.stores.scope import scoped_key
from prefixserve.replicas.policy import RoutingConfig, RoutingPolicy, routing_chain

logger = logging.getLogger(__name__)


class PrefixAwareRequestRouter(RequestRouter):
    def initialize_state(self, *, routing: dict, hub_name: str, namespace: str, hash_algo: str,
                         block_size: int, shared_stores: tuple = (), poll_period_s: float = 0.02) -> None:
        self.policy = RoutingPolicy(RoutingConfig(**routing))
        self.hash_algo = hash_algo
        # The model identity seeds every chain; the replicas publish it (it depends on the dtype
        # their device resolved). Until it is known every request routes as a miss.
        self.hasher: Optional[BlockHasher] = None
        self.block_size = block_size
        self._shared_stores = tuple(shared_stores)
        # Opened once every replica reports the same store scope (same weights, dtype, layout).
        self._store: Optional[KVStore] = None
        self._store_scope = ""
        self._hub_name, self._namespace = hub_name, namespace
        self._poll_period_s = poll_period_s
        self._follower: Optional[asyncio.Task] = None
        self._in_flight: dict[str, str] = {}       # internal request id -> replica
        self._loads: Counter = Counter()
        self.reasons: Counter = Counter()
        self.routed: Counter = Counter()           # replica -> requests routed
        self.matched_blocks: Counter = Counter()   # replica -> blocks the index said it held
        self._name = f"router-{os.getpid()}-{id(self):x}"

    # ------------------------------------------------------------- following
    def _ensure_follower(self) -> None:
        if self._follower is None or self._follower.done():
            self._follower = asyncio.get_running_loop().create_task(self._follow())

    async def _follow(self) -> None:
        try:
            hub = ray.get_actor(self._hub_name, namespace=self._namespace)
        except ValueError:
            logger.warning("no KV event hub %r: routing without a cache view", self._hub_name)
            return
        cursor = -1
        while True:
            try:
                if self.hasher is None or (self._shared_stores and self._store is None):
                    # what the replicas publish once they are up: until then, each poll asks again
                    stats = list((await hub.stats.remote()).values())
                    if self.hasher is None:
                        self._learn_model({s.get("model_identity") for s in stats} - {None})
                    if self._shared_stores and self._store is None:
                        self._open_store({s.get("kv_store_scope") for s in stats})
                cursor, changes = await hub.poll.remote(cursor)
                index = self.policy.index
                index.expire(self.policy.clock())
                if not index.follow(changes):
                    cursor = -1   # cannot happen with a hub that checked it; resync anyway
                await hub.report_routing.remote(self._name, self.routing_counts())
            except ray.exceptions.ActorDiedError:
                return   # the application is being deleted
            except (ray.exceptions.RayError, ConnectionError) as exc:
                logger.warning("KV event hub unreachable (%s); routing on the last view", exc)
            await asyncio.sleep(self._poll_period_s)

    def _learn_model(self, identities: set) -> None:
        if len(identities) > 1:
            logger.error("replicas serve different models: %s", sorted(identities))
        elif identities:
            self.hasher = BlockHasher(self.hash_algo, identities.pop())

    def _open_store(self, scopes: set) -> None:
        if len(scopes) != 1 or not next(iter(scopes)):
            return   # replicas not up yet, or not sharing one scope: their stores are not ours
        try:
            self._store = open_store(self._shared_stores[0])
        except (StoreError, ValueError) as exc:
            logger.warning("shared KV store %s unusable for routing: %s", self._shared_stores[0], exc)
            self._shared_stores = ()
            return
        self._store_scope = scopes.pop()

    async def _store_depth(self, chain: list) -> int:
        """Leading blocks of the chain the shared store holds; 0 on any fault (a miss)."""
        if self._store is None or not chain:
            return 0
        keys = [scoped_key(self._store_scope, h) for h in chain]
        try:
            # redis-py blocks (up to its socket timeout): not on this event loop
            held = await asyncio.to_thread(self._store.contains, keys)
        except StoreError:
            return 0
        return held.index(False) if False in held else len(held)

    def routing_counts(self) -> dict:
        return {"reasons": dict(self.reasons), "routed": dict(self.routed),
                "matched_blocks": dict(self.matched_blocks), "loads": dict(self._loads),
                "index_hashes": len(self.policy.index),
                "held": {r: self.policy.index.num_held(r) for r in self.policy.index.replicas}}

    # -------------------------------------------------------------- routing
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: Optional[PendingRequest] = None
                              ) -> list[list[RunningReplica]]:
        self._ensure_follower()
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        kwargs = pending_request.kwargs if pending_request is not None else {}
        target = kwargs.get("target_replica")
        if target is not None:
            return [[by_id[target]]] if target in by_id else []
        ids = sorted(by_id)
        loads = {r: self._loads[r] for r in ids}
        if pending_request is not None and pending_request.metadata.call_method == "generate" \
                and self.hasher is not None:
            chain = routing_chain(self.hasher, kwargs["token_ids"], self.block_size,
                                  kwargs.get("cache_salt"), kwargs.get("image_spans") or ())
            decision = self.policy.choose(ids, loads, chain, await self._store_depth(chain),
                                          routing_key=kwargs.get("routing_key"))
            self.reasons[decision.reason] += 1
            self.matched_blocks[decision.replica] += decision.matched_blocks
            first = decision.replica
        else:
            first = min(ids, key=lambda r: loads[r])
        rest = sorted((r for r in ids if r != first), key=lambda r: loads[r])
        return [[by_id[first]], [by_id[r] for r in rest]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result) -> None:
        rid = pending_request.metadata.internal_request_id
        self._in_flight[rid] = replica_id.unique_id
        self._loads[replica_id.unique_id] += 1
        if pending_request.metadata.call_method == "generate":
            self.routed[replica_id.unique_id] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        replica = self._in_flight.pop(internal_request_id, None)
        if replica is not None:
            self._loads[replica] -= 1
            if self._loads[replica] <= 0:
                del self._loads[replica]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget_replica(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = {r.unique_id for r in self.curr_replicas}
        super().update_replicas(replicas)
        for replica in before - {r.replica_id.unique_id for r in replicas}:
            self._forget_replica(replica)

    def _forget_replica(self, replica: str) -> None:
        """Its blocks died with it: no request may be routed to them, here or in other routers."""
        self.policy.index.forget(replica)
        self._loads.pop(replica, None)
        try:
            ray.get_actor(self._hub_name, namespace=self._namespace).gone.remote(replica)
        except ValueError:   # the hub is gone too (the application is shutting down)
            pass
