"""The engine's side of the KV stores: when to look up, load, spill and flush.

Each step, before scheduling, the waiting requests the step could admit have the blocks past
their pool hit looked up in the stores; verified blocks are loaded into freshly allocated
pool blocks (read straight into them), registered in the index and left cached, so the scheduler's own lookup finds
them as ordinary hits (and counts them as cached tokens). After scheduling, the blocks the
pool evicted are copied out (before the forward can overwrite them) and queued for the
background writer (write-back); with write-through, blocks are queued as soon as the step
that computed them has run. On close the pool's cached blocks are flushed to the persistent
stores.
"""
from __future__ import annotations

import logging
from typing import Iterable, Sequence

from prefixserve.kv import KVCacheManager
from prefixserve.kv.stores import (BackgroundWriter, BlockMeta, KeyScope, KVStoreStats,
                                   StoreChain, StoreError, open_store)
from prefixserve.model.config import ModelConfig, dtype_name
from prefixserve.model.kv_layout import kv_cache_bytes_per_block
from prefixserve.model.weights_digest import weights_digest
from prefixserve.scheduler import Request
from prefixserve.worker.kv_transfer import LoadTargets, payload_layout, read_blocks

logger = logging.getLogger(__name__)
# Copies made per call while flushing, so a large pool is never copied out at once.
_FLUSH_BATCH_BLOCKS = 64
# Blocks loaded per batch: bounds the memory a load holds (and a file store's read buffer).
_LOAD_BATCH_BLOCKS = 32


class KVStoreBridge:
    def __init__(self, urls: Sequence[str], *, kv: KVCacheManager, kv_caches: Sequence,
                 model, model_config: ModelConfig, block_size: int, kv_layout: str, hash_algo: str,
                 write_through: bool, max_queue_bytes: int) -> None:
        dtype = kv_caches[0].dtype
        self.scope = KeyScope(weights_digest=weights_digest(model), kv_dtype=dtype_name(dtype),
                              block_size=block_size,
                              kv_layout=payload_layout(model_config, block_size, kv_layout),
                              hash_algo=hash_algo)
        try:
            stores = [open_store(url) for url in urls]
        except StoreError as exc:
            raise ValueError(str(exc)) from None
        self.chain = StoreChain(stores, self.scope)
        self.writer = BackgroundWriter(self.chain, max_queue_bytes)
        self.kv = kv
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.write_through = write_through
        self.payload_bytes = kv_cache_bytes_per_block(model_config, block_size, dtype)
        self._looked_up: set[tuple[str, int]] = set()
        self._closed = False
        kv.enable_store_journal(write_through)

    # ------------------------------------------------------------- per step
    def before_schedule(self, waiting: Iterable[Request], num_running: int,
                        token_budget: int) -> None:
        """Loads from the stores the blocks the next waiting requests would hit there, as far
        as the pool has room and the step's token budget reaches."""
        room = self.kv.num_available_blocks() - num_running
        seen = set()
        bs = self.block_size
        for req in waiting:
            if room <= 0 or token_budget <= 0:
                break
            key = (req.request_id, req.num_preemptions)
            seen.add(key)
            if key in self._looked_up:
                continue
            self._looked_up.add(key)
            tokens = req.all_token_ids
            need = -(-len(tokens) // bs)
            hit, loaded = self._load_request(req, room)
            room -= need - hit
            token_budget -= len(tokens) - (hit + loaded) * bs
        self._looked_up &= seen

    def _load_request(self, req: Request, room: int) -> tuple[int, int]:
        """Loads the request's blocks past the pool's hit, a batch at a time (a long document
        never sits in memory twice over); returns (pool hit, blocks loaded) in blocks."""
        hit = loaded = 0
        while room > 1:
            lookup = self.kv.store_lookup(req.all_token_ids, cache_salt=req.cache_salt,
                                          image_spans=req.image_spans,
                                          max_blocks=min(room - 1, _LOAD_BATCH_BLOCKS))
            if not loaded:
                hit = len(lookup.prefix_ids)
            if not lookup.candidates:
                break
            loaded_now = self._load_batch(lookup)
            loaded += loaded_now
            room -= loaded_now
            if loaded_now < len(lookup.candidates):
                break
        return hit, loaded

    def _load_batch(self, lookup) -> int:
        """Loads the lookup's candidates the stores hold into pool blocks imported for them,
        read in place; blocks that could not be loaded are dropped from the index again."""
        imported: list[int] = []
        targets: list[LoadTargets] = []

        def reserve(n: int):
            imported.extend(self.kv.import_blocks(lookup, n))
            # What importing evicted is copied out before the loads overwrite it.
            self._spill(self.kv.take_evicted())
            targets.append(LoadTargets(self.kv_caches, imported))
            return targets[0].buffers

        count = 0
        try:
            count = self.chain.load_into(lookup.candidates, reserve)
            if targets:
                targets[0].commit(count)
        except Exception:   # store faults are counted inside; anything else is a bug
            count = 0
            logger.exception("loading KV blocks from the stores failed; computing them")
        # Registered but not loaded: they must never be hit.
        self.kv.forget_blocks(imported[count:])
        return count

    def after_schedule(self) -> None:
        """Copies out what scheduling evicted, before the forward reuses those blocks."""
        self._spill(self.kv.take_evicted())

    def after_step(self, ok: bool) -> None:
        if not self.write_through:
            return
        if ok:
            self._spill(self.kv.take_computed())
        else:
            self.kv.discard_computed()

    def _spill(self, blocks: Sequence[tuple[int, BlockMeta]], wait: bool = False,
               persistent_only: bool = False) -> None:
        if not blocks:
            return
        if not wait:
            # Copy out only what the writer's queue can take: the rest would be dropped anyway.
            fit = max(1, self.writer.free_bytes() // self.payload_bytes)
            if fit < len(blocks):
                self.chain.note_dropped(len(blocks) - fit)
                blocks = blocks[:fit]
        try:
            rows = read_blocks(self.kv_caches, [b for b, _ in blocks])
        except Exception:
            logger.exception("copying %d KV blocks out of the pool failed; not stored", len(blocks))
            self.chain.note_dropped(len(blocks))
            return
        for (_, meta), row in zip(blocks, rows):
            self.writer.submit(meta, row, row.nbytes, wait=wait, persistent_only=persistent_only)

    # ------------------------------------------------------------- lifecycle
    def holds(self, block_hashes: Sequence[bytes]) -> list:
        return self.chain.holds(block_hashes)

    def stats(self) -> list[KVStoreStats]:
        return self.chain.stats()

    def close(self) -> None:
        """Flushes the pool's cached blocks to the persistent stores, then what host-memory
        stores hold, and closes the stores. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._spill(self.kv.take_evicted())
            if any(s.persistent for s in self.chain.stores):
                cached = self.kv.cached_blocks()
                for i in range(0, len(cached), _FLUSH_BATCH_BLOCKS):
                    self._spill(cached[i:i + _FLUSH_BATCH_BLOCKS], wait=True, persistent_only=True)
            self.writer.close()
            self.chain.drain_volatile()
        finally:
            self.kv.disable_store_journal()
            self.chain.close()
