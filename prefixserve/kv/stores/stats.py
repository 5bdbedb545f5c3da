"""Per-store counters, in blocks, bytes and seconds."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KVStoreStats:
    store: str               # the URL without credentials
    hits: int = 0            # blocks loaded from this store into the pool
    misses: int = 0          # blocks asked of this store that it could not serve
    bytes_read: int = 0
    bytes_written: int = 0
    load_seconds: float = 0.0  # reading and verifying the blocks it served or rejected
    writes: int = 0          # records written (spills from a faster store included)
    dropped_writes: int = 0  # blocks not written: the writer's queue was full, or every store failing
    rejected: int = 0        # records read and refused: corrupt, truncated, stale, other format
    forged: int = 0          # of those, records whose MAC did not verify (store with a MAC key)
    errors: int = 0          # faults: unreachable, I/O errors, disk full
    records: int = -1        # records held (-1: not counted, a remote store)
    bytes_held: int = -1
