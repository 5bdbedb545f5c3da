"""The meeting point of KV events: replicas publish to it, routers follow it.

A replica cannot call a router (the router lives inside whichever process holds a handle), so
each replica pushes its KV events and stats to one named Ray actor per application, and every
router pulls from it. The hub keeps each replica's current set of hashes (bounded by that
replica's pool) and a bounded log of recent changes: a router whose cursor is still in the log
gets the changes, one that fell behind (or just started) gets every replica's full set.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Optional

from prefixserve.kv.events import KVEventBatch
from prefixserve.replicas.index import BlockIndex

# (seq, replica, ("events", KVEventBatch) | ("snapshot", hashes) | ("gone", None))
Change = tuple[int, str, tuple[str, Any]]


class KVEventHub:
    def __init__(self, log_capacity: int = 4096) -> None:
        if isinstance(log_capacity, bool) or not isinstance(log_capacity, int) or log_capacity < 1:
            raise ValueError(f"log_capacity must be a positive int, got {log_capacity!r}")
        self._mirror = BlockIndex(capacity=2 ** 62)   # bounded by the replicas' pools instead
        self._log: deque[Change] = deque(maxlen=log_capacity)
        self._seq = 0
        self._stats: dict[str, Any] = {}
        self._routing: dict[str, dict[str, Any]] = {}

    def _append(self, replica: str, change: tuple[str, Any]) -> None:
        self._seq += 1
        self._log.append((self._seq, replica, change))

    def publish(self, replica: str, batch: Optional[KVEventBatch] = None,
                snapshot: Optional[list[bytes]] = None, stats: Any = None) -> bool:
        """A replica's news: a snapshot (it started, or its log overflowed) or events. Returns
        False when the events overflowed: the replica must publish a snapshot next."""
        if stats is not None:
            self._stats[replica] = stats
        if snapshot is not None:
            self._mirror.rebuild(replica, snapshot)
            self._append(replica, ("snapshot", list(snapshot)))
        elif batch is not None and batch.events:
            if not self._mirror.apply(replica, batch):
                return False
            self._append(replica, ("events", batch))
        elif batch is not None and batch.overflowed:
            return False
        return True

    def gone(self, replica: str) -> None:
        """The replica died or was replaced: nobody should route to its blocks any more."""
        self._mirror.forget(replica)
        self._stats.pop(replica, None)
        self._append(replica, ("gone", None))

    def poll(self, cursor: int) -> tuple[int, list[Change]]:
        """Changes after cursor; a full resync (a snapshot of every replica) when the log no
        longer reaches back to it."""
        if cursor == self._seq:
            return cursor, []
        if self._log and cursor >= self._log[0][0] - 1 and cursor <= self._seq:
            return self._seq, [c for c in self._log if c[0] > cursor]
        return self._seq, [(self._seq, "*", ("resync", None))] + [
            (self._seq, r, ("snapshot", self._mirror.held(r))) for r in self._mirror.replicas]

    def stats(self) -> dict[str, Any]:
        return dict(self._stats)

    def report_routing(self, router: str, counts: dict[str, Any]) -> None:
        self._routing[router] = counts

    def routing(self) -> dict[str, dict[str, Any]]:
        return dict(self._routing)
