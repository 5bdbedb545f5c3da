"""The background writer: blocks leave the engine thread as copies and are written here.

The queue is bounded in bytes; a block that does not fit is dropped and counted, so a slow
store costs cache, never a model step.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Optional

from prefixserve.kv.stores.chain import StoreChain
from prefixserve.kv.stores.record import BlockMeta

logger = logging.getLogger(__name__)


class BackgroundWriter:
    def __init__(self, chain: StoreChain, max_queue_bytes: int) -> None:
        if isinstance(max_queue_bytes, bool) or not isinstance(max_queue_bytes, int) \
                or max_queue_bytes < 1:
            raise ValueError(f"max_queue_bytes must be a positive int, got {max_queue_bytes!r}")
        self.chain = chain
        self.max_queue_bytes = max_queue_bytes
        self._queue: deque[tuple[BlockMeta, object, int, bool]] = deque()
        self._queued_bytes = 0
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="prefixserve-kv-writer",
                                        daemon=True)
        self._thread.start()

    def submit(self, meta: BlockMeta, payload, nbytes: int, *, wait: bool = False,
               persistent_only: bool = False) -> bool:
        """Queues a block; False (and counted as dropped) when the queue is full. With wait,
        blocks until there is room instead (shutdown flushes must not lose blocks)."""
        with self._cond:
            if self._closed:
                return False
            while wait and self._queue and self._queued_bytes + nbytes > self.max_queue_bytes:
                self._cond.wait()
            if self._queue and self._queued_bytes + nbytes > self.max_queue_bytes:
                self.chain.note_dropped()
                return False
            self.chain.stage(meta, payload)   # before the writer thread can take it
            self._queue.append((meta, payload, nbytes, persistent_only))
            self._queued_bytes += nbytes
            self._cond.notify_all()
            return True

    def free_bytes(self) -> int:
        """Room left in the queue (what can be submitted now without a drop)."""
        with self._cond:
            return self.max_queue_bytes - self._queued_bytes if self._queue else self.max_queue_bytes

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Waits until every queued block has been written; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: Optional[float] = None) -> None:
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                meta, payload, nbytes, persistent_only = self._queue.popleft()
                self._busy = True
            try:
                self.chain.write(meta, payload, persistent_only=persistent_only)
            except Exception:
                logger.exception("writing a KV block to the stores failed")
            finally:
                with self._cond:
                    self._queued_bytes -= nbytes
                    self._busy = False
                    self._cond.notify_all()
