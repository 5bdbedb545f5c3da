"""The stores beneath the pool, fastest first.

Lookups walk a request's chain of block hashes past the pool's hit: the next block is taken
from the first store that holds it and whose record verifies, and the walk stops at the
first block no store can serve. Blocks are read straight into the memory they are loaded
into and verified there. Writes go to the first store; what a store evicts spills to
the next one. A store that fails is counted and logged once, then left alone for a moment so
a dead server costs one timeout per interval, not one per request; every fault is a miss.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Sequence

from prefixserve.kv.stores.base import KVStore, StoreError
from prefixserve.kv.stores.record import (CHECKSUM_BYTES, BlockMeta, RecordError, encode_head,
                                          encode_parts, reseal, verify)
from prefixserve.kv.stores.scope import KeyScope
from prefixserve.kv.stores.stats import KVStoreStats

logger = logging.getLogger(__name__)
RETRY_AFTER_S = 2.0
# Blocks read and verified at once: enough to keep a disk's queue and both cores busy.
_READERS = 4


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
        self._readers: Optional[ThreadPoolExecutor] = None   # started by the first batched read
        # Blocks queued for writing and not yet placed, by hash: lookups find them here, so
        # a block evicted from the pool is never recomputed for want of a slow writer.
        self._staged: dict[bytes, tuple[BlockMeta, memoryview]] = {}

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
        with self._lock:
            # A staged block is read from the staging and counted for the first store.
            found: list[Optional[int]] = [0 if h in self._staged else None for h in block_hashes]
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

    def load_into(self, metas: Sequence[BlockMeta],
                  reserve: Callable[[int], Sequence[Sequence[memoryview]]]) -> int:
        """Loads the leading blocks of `metas` (consecutive blocks of one chain), each from the
        first store that holds it and whose record verifies, and stops at the first block none
        can serve. Once it knows how many leading blocks the stores hold, it asks
        `reserve(n)` for where to put them: each block's payload as writable buffers in
        payload order (for at most n blocks). Returns how many leading blocks were loaded: the
        buffers after them may hold anything. A run of blocks held by one store is read and
        verified in parallel."""
        where: list[int] = []   # the store holding each leading block, up to the first none holds
        for s in self.holds([m.block_hash for m in metas]):
            if s is None:
                break
            where.append(s)
        n = len(where)
        targets = reserve(n) if n else []
        if len(targets) < n:
            n, where = len(targets), where[:len(targets)]
            metas = metas[:n]
        i = 0
        while i < n:
            s = where[i]
            j = i
            while j < n and where[j] == s:
                j += 1
            ok = self._read_run(s, metas[i:j], targets[i:j])
            for k in range(i, j):
                served = s
                if not ok[k - i]:
                    served = next((t for t in range(s + 1, len(self.stores))
                                   if self._read_run(t, [metas[k]], [targets[k]])[0]),
                                  len(self.stores))
                with self._lock:
                    # Every store before the one that served it (all of them on a miss) missed.
                    for m in range(served):
                        self._stats[m].misses += 1
                    if served < len(self.stores):
                        self._stats[served].hits += 1
                if served == len(self.stores):
                    return k
            i = j
        if n < len(metas):
            with self._lock:
                for st in self._stats:
                    st.misses += 1
        return n

    def _read_run(self, i: int, metas: Sequence[BlockMeta],
                  targets: Sequence[Sequence[memoryview]]) -> list[bool]:
        """Reads and verifies blocks from store i into their targets, a few at a time (reads
        and checksums release the GIL); whether each was loaded. A record that fails
        verification is counted, logged and deleted."""
        up = self._up(i)
        store = self.stores[i]
        payload_bytes = sum(b.nbytes for b in targets[0])

        def one(k: int) -> tuple[Optional[int], Optional[RecordError]]:
            size = self._read_staged(metas[k], targets[k])
            if size is not None or not up:
                return size, None
            head = encode_head(self._scope_digest, metas[k], payload_bytes)
            got_head, checksum = bytearray(len(head)), bytearray(CHECKSUM_BYTES)
            size = store.read_into(self.scope.key(metas[k].block_hash),
                                   [memoryview(got_head), *targets[k], memoryview(checksum)])
            if size is None:
                return None, None
            try:
                verify(head, size, got_head, targets[k], checksum, store.mac)
            except RecordError as exc:
                return size, exc
            return size, None

        t0 = time.perf_counter()
        try:
            if len(metas) == 1:
                results = [one(0)]
            else:
                if self._readers is None:
                    self._readers = ThreadPoolExecutor(_READERS, thread_name_prefix="prefixserve-kv-read")
                results = list(self._readers.map(one, range(len(metas))))
        except StoreError as exc:
            self._fault(i, exc)
            return [False] * len(metas)
        if up:
            self._ok(i)
        ok = []
        with self._lock:
            st = self._stats[i]
            st.load_seconds += time.perf_counter() - t0
            for size, error in results:
                if size is not None and error is None:
                    st.bytes_read += size
                    ok.append(True)
                else:
                    ok.append(False)
                st.rejected += error is not None
                st.forged += error is not None and error.reason == "forged"
        for meta, (size, error) in zip(metas, results):
            if error is not None:
                key = self.scope.key(meta.block_hash)
                logger.info("KV store %s: record %s refused (%s); deleted", store.display, key, error)
                self._delete_quietly(i, key)
        return ok

    def _read_staged(self, meta: BlockMeta, buffers: Sequence[memoryview]) -> Optional[int]:
        """Copies a staged block's payload into buffers; its size, None when not staged. Our
        own memory, so nothing to verify but that it is the block asked for."""
        with self._lock:
            staged = self._staged.get(meta.block_hash)
        if staged is None or staged[0] != meta:
            return None
        view = staged[1]
        if view.nbytes != sum(b.nbytes for b in buffers):
            return None
        pos = 0
        for b in buffers:
            b[:] = view[pos:pos + b.nbytes]
            pos += b.nbytes
        return view.nbytes

    def _delete_quietly(self, i: int, key: str) -> None:
        try:
            self.stores[i].delete(key)
        except StoreError as exc:
            self._fault(i, exc)

    # -------------------------------------------------------------- writes
    def stage(self, meta: BlockMeta, payload) -> None:
        """Makes a block queued for writing findable until write() has placed it."""
        with self._lock:
            self._staged[meta.block_hash] = (meta, memoryview(payload).cast("B"))

    def write(self, meta: BlockMeta, payload, persistent_only: bool = False) -> None:
        """Writes a block into the first (persistent, with persistent_only) store that is up,
        unless it holds the block already; what that store evicts spills onward. Then it is
        no longer staged."""
        try:
            self._write(meta, payload, persistent_only)
        finally:
            with self._lock:
                if self._staged.get(meta.block_hash, (None,))[0] == meta:
                    del self._staged[meta.block_hash]

    def _write(self, meta: BlockMeta, payload, persistent_only: bool) -> None:
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
            self._put(i, key, encode_parts(self._scope_digest, meta, payload, store.mac))
            return
        self.note_dropped()   # every store that could take it is failing

    def _put(self, i: int, key: str, parts) -> None:
        """Puts a record into store i and spills its evictions into the stores after it."""
        # (store, key, record, the store above it still holds it in, if it is spilling)
        pending: list[tuple[int, str, tuple, Optional[int]]] = [(i, key, parts, None)]
        while pending:
            i, key, parts, above = pending.pop()
            spill = i + 1 < len(self.stores)
            evicted = []
            try:
                evicted = self.stores[i].put(key, parts, spill=spill)
            except StoreError as exc:
                self._fault(i, exc)
            else:
                self._ok(i)
                size = sum(memoryview(p).nbytes for p in parts)
                with self._lock:
                    self._stats[i].writes += 1
                    self._stats[i].bytes_written += size
            if above is not None:
                # Only now, placed below (or lost with a failing store), does it leave.
                self._delete_quietly(above, key)
            for k, v in evicted:
                moved = self._resealed(i, i + 1, k, v) if self._up(i + 1) else None
                if moved is not None:
                    pending.append((i + 1, k, moved, i))
                else:
                    self._delete_quietly(i, k)

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
                moved = self._resealed(i, nxt, key, data) if self._up(nxt) else None
                if moved is not None:
                    self._put(nxt, key, moved)

    def _resealed(self, src: int, dst: int, key: str, record) -> Optional[tuple]:
        """A record moving from store src to store dst, sealed for dst; None (counted as
        refused by src) when its seal in src does not verify."""
        moved = reseal(record, self.stores[src].mac, self.stores[dst].mac)
        if moved is None:
            with self._lock:
                self._stats[src].rejected += 1
                self._stats[src].forged += self.stores[src].mac is not None
            logger.info("KV store %s: record %s refused on its way to %s (its seal does not "
                        "verify)", self.stores[src].display, key, self.stores[dst].display)
        return moved

    # --------------------------------------------------------------- stats
    def stats(self) -> list[KVStoreStats]:
        with self._lock:
            out = [KVStoreStats(**vars(s)) for s in self._stats]
        for s, store in zip(out, self.stores):
            if not store.remote:
                s.records, s.bytes_held = store.usage()
        return out

    def close(self) -> None:
        if self._readers is not None:
            self._readers.shutdown(wait=True)
        for store in self.stores:
            store.close()
