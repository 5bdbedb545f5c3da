"""The router's view of which replica holds which KV blocks, fed by the replicas' KV events.

Keys are the engines' own chained block hashes, so a match here is a match in the engine (up to
an eviction the router has not heard of yet). The index is bounded: past `capacity` hashes the
least recently stored or matched one is forgotten for every replica, which can only cost a
routing hit, never a wrong answer (the engine checks every block it reuses).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterable, Sequence

from prefixserve.kv.events import CLEARED, PINNED, REMOVED, STORED, KVEventBatch
from prefixserve.kv.hashing import BlockHash

ReplicaKey = Hashable


class BlockIndex:
    def __init__(self, capacity: int = 1_000_000) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        self.capacity = capacity
        # hash -> replicas holding it; order = least recently stored or matched first
        self._holders: OrderedDict[BlockHash, set[ReplicaKey]] = OrderedDict()
        self._held: dict[ReplicaKey, set[BlockHash]] = {}
        # (replica, hash) -> deadline: blocks a replica was sent to compute, held until its
        # events confirm them (then plain entries) or the deadline passes unconfirmed.
        self._expected: dict[tuple[ReplicaKey, BlockHash], float] = {}
        self.num_dropped = 0  # hashes forgotten for want of room

    def __len__(self) -> int:
        return len(self._holders)

    @property
    def replicas(self) -> list[ReplicaKey]:
        return list(self._held)

    def held(self, replica: ReplicaKey) -> list[BlockHash]:
        return list(self._held.get(replica, ()))

    def num_held(self, replica: ReplicaKey) -> int:
        return len(self._held.get(replica, ()))

    def holds(self, replica: ReplicaKey, block_hash: BlockHash) -> bool:
        return block_hash in self._held.get(replica, ())

    def add(self, replica: ReplicaKey, hashes: Iterable[BlockHash]) -> None:
        held = self._held.setdefault(replica, set())
        holders = self._holders
        for h in hashes:
            owners = holders.get(h)
            if owners is None:
                holders[h] = {replica}
                if len(holders) > self.capacity:
                    self._drop_oldest()
            else:
                owners.add(replica)
                holders.move_to_end(h)
            held.add(h)

    def expect(self, replica: ReplicaKey, hashes: Iterable[BlockHash], deadline: float) -> None:
        """The replica was just sent these blocks to compute: route their prefix to it too,
        before its events say it stored them (requests of one tenant arriving together would
        otherwise each look like a miss and scatter)."""
        new = [h for h in hashes if not self.holds(replica, h)]
        self.add(replica, new)
        for h in new:
            self._expected[(replica, h)] = deadline

    def expire(self, now: float) -> None:
        """Drops expected blocks whose replica never confirmed them by the deadline."""
        late = [key for key, deadline in self._expected.items() if deadline <= now]
        for replica, h in late:
            del self._expected[(replica, h)]
            self.remove(replica, (h,))

    def _drop_oldest(self) -> None:
        h, owners = self._holders.popitem(last=False)
        for replica in owners:
            self._held[replica].discard(h)
        self.num_dropped += 1

    def remove(self, replica: ReplicaKey, hashes: Iterable[BlockHash]) -> None:
        held = self._held.get(replica)
        if held is None:
            return
        holders = self._holders
        for h in hashes:
            if h in held:
                held.discard(h)
                owners = holders[h]
                owners.discard(replica)
                if not owners:
                    del holders[h]

    def forget(self, replica: ReplicaKey) -> None:
        """Drops everything the replica held (it died, restarted, or was reset)."""
        if self._expected:
            self._expected = {k: d for k, d in self._expected.items() if k[0] != replica}
        holders = self._holders
        for h in self._held.pop(replica, ()):
            owners = holders[h]
            owners.discard(replica)
            if not owners:
                del holders[h]

    def apply(self, replica: ReplicaKey, batch: KVEventBatch) -> bool:
        """Applies a replica's events in order; False if the batch overflowed, and the caller
        must rebuild this replica from a snapshot."""
        if batch.overflowed:
            return False
        for event in batch.events:
            if event.kind in (STORED, PINNED):
                if self._expected:
                    for h in event.hashes:
                        self._expected.pop((replica, h), None)
                self.add(replica, event.hashes)
            elif event.kind == REMOVED:
                self.remove(replica, event.hashes)
            elif event.kind == CLEARED:
                self.forget(replica)
                self._held[replica] = set()
        return True

    def follow(self, changes: Iterable) -> bool:
        """Applies a hub poll's changes, (cursor, replica, (kind, payload)) each; False if a
        batch could not be applied and the follower must resync from the hub."""
        ok = True
        for _, replica, (kind, payload) in changes:
            if kind == "resync":
                for known in self.replicas:
                    self.forget(known)
            elif kind == "gone":
                self.forget(replica)
            elif kind == "snapshot":
                self.rebuild(replica, payload)
            elif not self.apply(replica, payload):
                ok = False
        return ok

    def rebuild(self, replica: ReplicaKey, hashes: Iterable[BlockHash]) -> None:
        """Replaces what the replica holds by a snapshot of it."""
        self.forget(replica)
        self.add(replica, hashes)

    def longest_prefix(self, chain: Sequence[BlockHash]) -> dict[ReplicaKey, int]:
        """For each replica holding chain[0]: how many leading blocks of chain it holds. Matched
        hashes count as recently used, so the bound forgets cold prefixes first."""
        holders = self._holders
        if not chain or chain[0] not in holders:
            return {}
        alive = set(holders[chain[0]])
        depth = {r: 1 for r in alive}
        holders.move_to_end(chain[0])
        for i in range(1, len(chain)):
            owners = holders.get(chain[i])
            if owners is None:
                break
            holders.move_to_end(chain[i])
            alive &= owners
            if not alive:
                break
            for r in alive:
                depth[r] = i + 1
        return depth
