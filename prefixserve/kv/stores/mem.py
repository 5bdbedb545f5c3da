"""`mem://`: host memory beyond the pool, least recently used records evicted first."""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Iterator, Optional, Sequence

from prefixserve.kv.stores.base import KVStore, RecordParts
from prefixserve.kv.stores.url import StoreSpec


class MemStore(KVStore):
    def __init__(self, spec: StoreSpec) -> None:
        super().__init__(spec)
        if spec.size is None:
            raise ValueError(f"a mem store needs a size in bytes: {spec.display}")
        self.capacity: int = spec.size
        self._records: OrderedDict[str, bytes] = OrderedDict()
        # Evicted with spill and not yet deleted by the chain: readable, no longer counted.
        self._leaving: dict[str, bytes] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> Optional[bytes]:
        with self._lock:
            data = self._records.get(key)
            if data is not None:
                self._records.move_to_end(key)
                return data
            return self._leaving.get(key)

    def contains(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [k in self._records or k in self._leaving for k in keys]

    def put(self, key: str, parts: RecordParts, spill: bool = False) -> list[tuple[str, bytes]]:
        data = b"".join(parts)
        if len(data) > self.capacity:
            return [(key, data)]   # never fits: straight on to the next store
        evicted = []
        with self._lock:
            old = self._records.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
            while self._bytes + len(data) > self.capacity:
                k, v = self._records.popitem(last=False)
                self._bytes -= len(v)
                if spill:
                    self._leaving[k] = v
                    evicted.append((k, v))
            self._records[key] = data
            self._bytes += len(data)
        return evicted

    def delete(self, key: str) -> None:
        with self._lock:
            old = self._records.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
            self._leaving.pop(key, None)

    def scan(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        with self._lock:
            items = [(k, len(v)) for k, v in self._records.items() if k.startswith(prefix)]
        return iter(items)

    def drain(self) -> list[tuple[str, bytes]]:
        """Takes every record out, oldest first (to spill them into a persistent store)."""
        with self._lock:
            items = list(self._records.items())
            self._records.clear()
            self._bytes = 0
        return items

    def usage(self) -> tuple[int, int]:
        with self._lock:
            return len(self._records), self._bytes
