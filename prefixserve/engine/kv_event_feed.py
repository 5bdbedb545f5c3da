"""What the pool holds, for a router that follows this engine: a snapshot, then the changes.

The event log starts with the first snapshot, so an engine nobody follows records nothing.
"""
from __future__ import annotations

from typing import Optional

from prefixserve.kv import KVCacheManager
from prefixserve.kv.events import KVEventBatch, KVEventLog


class KVEventFeed:
    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self._log: Optional[KVEventLog] = None  # started by the first snapshot()

    def snapshot(self) -> list[bytes]:
        """Every block hash the pool holds now, and (re)starts the KV event log from this point:
        a router rebuilds its view of this engine from it, then follows events()."""
        if self._log is None:
            self._log = KVEventLog()
            self.kv.watch(self._log)
        self._log.restart()
        return self.kv.cached_hashes()

    def events(self) -> KVEventBatch:
        """The hashes stored, removed and pinned, and the resets, since the last call; overflowed
        (take a snapshot) before the first snapshot() or when the consumer fell too far behind."""
        if self._log is None:
            return KVEventBatch((), overflowed=True)
        return self._log.drain()
