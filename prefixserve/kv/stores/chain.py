"""The stores beneath the pool, fastest first.

Lookups walk a request's chain of block hashes past the pool's hit: the next block is taken
from the first store that holds it and whose record verifies, and the walk stops at the
first block no store can serve. Writes go to the first store; what a store evicts spills to
the next one. A store that fails is counted and logged once, then left alone for a moment so
a dead server costs one timeout per interval, not one per request; every fault is a miss.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional, Sequence

from prefixserve.kv.stores.base import KVStore, StoreError
from prefixserve.kv.stores.record import BlockMeta, RecordError, decode, encode_parts
from prefixserve.kv.stores.scope import KeyScope
from prefixserve.kv.stores.stats import KVStoreStats

logger = logging.getLogger(__name__)
RETRY_AFTER_S = 2.0


class StoreChain:
    def __init__(self, stores: Sequence[KVStore], scope: KeyScope,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not stores:
            raise ValueError("a store chain needs at least one store")
        self.stores = list(stores)
        self.scope = scope
        self._scope_digest = scope.digest
        self._clock = clock
        self._lock = threading.Lock()
        self._stats = [KVStoreStats(store=s.display) for s in self.stores]
        self._down_until = [0.0] * len(self.stores)
        self._failing = [False] * len(self.stores)

    # ------------------------------------------------------------- faults
    def _up(self, i: int) -> bool:
        return self._clock() >= self._down_until[i]

    def _fault(self, i: int, exc: Exception) -> None:
        with self._lock:
            self._stats[i].errors += 1
            first = not self._failing[i]
            self._failing[i] = True
            self._down_until[i] = self._clock() + RETRY_AFTER_S
        if first:
            logger.warning("KV store %s failed (%s); its blocks are misses until it answers "
                           "again", self.stores[i].display, exc)

    def _ok(self, i: int) -> None:
        if self._failing[i]:
            self._failing[i] = False
            logger.warning("KV store %s answers again", self.stores[i].display)

    # ------------------------------------------------------------- lookup
    def holds(self, block_hashes: Sequence[bytes]) -> list[Optional[int]]:
        """For each block hash, the index of the first store that holds it (None: none does).
        One batched call per store; nothing is read or verified."""
        keys = [self.scope.key(h) for h in block_hashes]
        found: list[Optional[int]] = [None] * len(keys)
        for i, store in enumerate(self.stores):
            todo = [j for j, f in enumerate(found) if f is None]
            if not todo or not self._up(i):
                continue
            try:
                held = store.contains([keys[j] for j in todo])
            except StoreError as exc:
                self._fault(i, exc)
                continue
            self._ok(i)
            for j, h in zip(todo, held):
                if h:
                    found[j] = i
        return found

    def load(self, metas: Sequence[BlockMeta], payload_bytes: int) -> list[memoryview]:
        """Payloads of the leading blocks of `metas` (consecutive blocks of one chain) that a
        store holds and whose records verify against them; stops at the first block none can
        serve. Runs of blocks held by one store are read in one batched call."""
        where = self.holds([m.block_hash for m in metas])
        n = where.index(None) if None in where else len(where)
        out: list[memoryview] = []
        i = 0
        while i < n:
            s = where[i]
            j = i
            while j < n and where[j] == s:
                j += 1
            datas = self._get_many(s, [self.scope.key(m.block_hash) for m in metas[i:j]])
            for k, data in zip(range(i, j), datas):
                payload = self._verify(s, metas[k], data, payload_bytes)
                served = s
                if payload is None:
                    found = self._load_one(metas[k], s + 1, payload_bytes)
                    payload, served = found if found is not None else (None, len(self.stores))
                # Every store before the one that served it (all of them on a miss) missed.
                with self._lock:
                    for m in range(served):
                        self._stats[m].misses += 1
                if payload is None:
                    return out
                out.append(payload)
            i = j
        if n < len(metas):
            with self._lock:
                for st in self._stats:
                    st.misses += 1
        return out

    def _get_many(self, i: int, keys: list[str]) -> list[Optional[bytes]]:
        if not self._up(i):
            return [None] * len(keys)
        t0 = time.perf_counter()
        try:
            datas = self.stores[i].get_many(keys)
        except StoreError as exc:
            self._fault(i, exc)
            return [None] * len(keys)
        self._ok(i)
        with self._lock:
            self._stats[i].load_seconds += time.perf_counter() - t0
        return datas

    def _verify(self, i: int, meta: BlockMeta, data: Optional[bytes],
                payload_bytes: int) -> Optional[memoryview]:
        """The payload of a record read from store i, counted as a hit, or None (a record
        that fails verification is counted, logged and deleted)."""
        if data is None:
            return None
        t0 = time.perf_counter()
        try:
            payload = decode(data, self._scope_digest, meta, payload_bytes)
        except RecordError as exc:
            key = self.scope.key(meta.block_hash)
            with self._lock:
                self._stats[i].rejected += 1
                self._stats[i].load_seconds += time.perf_counter() - t0
            logger.info("KV store %s: record %s refused (%s); deleted", self.stores[i].display,
                        key, exc)
            self._delete_quietly(i, key)
            return None
        with self._lock:
            st = self._stats[i]
            st.hits += 1
            st.bytes_read += len(data)
            st.load_seconds += time.perf_counter() - t0
        return payload

    def _load_one(self, meta: BlockMeta, first: int,
                  payload_bytes: int) -> Optional[tuple[memoryview, int]]:
        """The block from the first store at or after `first` that serves it."""
        key = self.scope.key(meta.block_hash)
        for i in range(first, len(self.stores)):
            if not self._up(i):
                continue
            # get, not get_many: blocks already taken from this store may live in the buffer
            # its get_many reuses.
            t0 = time.perf_counter()
            try:
                data = self.stores[i].get(key)
            except StoreError as exc:
                self._fault(i, exc)
                continue
            self._ok(i)
            with self._lock:
                self._stats[i].load_seconds += time.perf_counter() - t0
            payload = self._verify(i, meta, data, payload_bytes)
            if payload is not None:
                return payload, i
        return None

    def _delete_quietly(self, i: int, key: str) -> None:
        try:
            self.stores[i].delete(key)
        except StoreError as exc:
            self._fault(i, exc)

    # -------------------------------------------------------------- writes
    def write(self, meta: BlockMeta, payload, persistent_only: bool = False) -> None:
        """Writes a block into the first (persistent, with persistent_only) store that is up,
        unless it holds the block already; what that store evicts spills onward."""
        key = self.scope.key(meta.block_hash)
        for i, store in enumerate(self.stores):
            if persistent_only and not store.persistent:
                continue
            if not self._up(i):
                continue
            try:
                if store.contains([key])[0]:
                    return
            except StoreError as exc:
                self._fault(i, exc)
                continue
            self._put(i, key, encode_parts(self._scope_digest, meta, payload))
            return
        self.note_dropped()   # every store that could take it is failing

    def _put(self, i: int, key: str, parts) -> None:
        """Puts a record into store i and spills its evictions into the stores after it."""
        pending = [(i, key, parts)]
        while pending:
            i, key, parts = pending.pop()
            spill = i + 1 < len(self.stores)
            try:
                evicted = self.stores[i].put(key, parts, spill=spill)
            except StoreError as exc:
                self._fault(i, exc)
                continue
            self._ok(i)
            size = sum(memoryview(p).nbytes for p in parts)
            with self._lock:
                self._stats[i].writes += 1
                self._stats[i].bytes_written += size
            if spill:
                pending += [(i + 1, k, (v,)) for k, v in evicted if self._up(i + 1)]

    def note_dropped(self, n: int = 1) -> None:
        with self._lock:
            self._stats[0].dropped_writes += n

    def drain_volatile(self) -> None:
        """Moves what host-memory stores hold into the persistent stores after them (on a
        clean shutdown)."""
        for i, store in enumerate(self.stores):
            nxt = next((j for j in range(i + 1, len(self.stores))
                        if self.stores[j].persistent), None)
            if store.persistent or nxt is None or not hasattr(store, "drain"):
                continue
            for key, data in store.drain():
                if self._up(nxt):
                    self._put(nxt, key, (data,))

    # --------------------------------------------------------------- stats
    def stats(self) -> list[KVStoreStats]:
        with self._lock:
            out = [KVStoreStats(**vars(s)) for s in self._stats]
        for s, store in zip(out, self.stores):
            if not store.remote:
                s.records, s.bytes_held = store.usage()
        return out

    def close(self) -> None:
        for store in self.stores:
            store.close()
