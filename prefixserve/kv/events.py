"""KV events: what a pool holds, told as chained block hashes, for a router that sees many pools.

A pool reports each hash it starts holding (`stored`), each it stops holding (`removed`: evicted,
uncached, rewound), the hashes a pin holds (`pinned`) and a reset (`cleared`). Salts are inside
the hashes already, so an event never carries a tenant's name or tokens. The log
is bounded: a consumer that falls more than `capacity` hashes behind is told the log overflowed
and rebuilds its view from a snapshot (every hash held now) instead of from events.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from prefixserve.kv.hashing import BlockHash

STORED = "stored"
REMOVED = "removed"
PINNED = "pinned"
CLEARED = "cleared"
EVENT_KINDS = (STORED, REMOVED, PINNED, CLEARED)


@dataclass(frozen=True)
class KVEvent:
    kind: str
    hashes: tuple[BlockHash, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"kind must be one of {EVENT_KINDS}, got {self.kind!r}")


@dataclass(frozen=True)
class KVEventBatch:
    """Events since the previous drain, oldest first. When overflowed, events were dropped and
    `events` is empty: the consumer must take a snapshot."""
    events: tuple[KVEvent, ...]
    overflowed: bool = False


class KVEventLog:
    """The pool's observer. Consecutive events of one kind share one KVEvent, so a step that
    stores 40 blocks costs one entry, not 40."""

    def __init__(self, capacity: int = 65536) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        self.capacity = capacity
        self._kinds: list[str] = []
        self._hashes: list[list[BlockHash]] = []
        self._size = 0
        self._overflowed = False

    def _add(self, kind: str, hashes: Iterable[BlockHash]) -> None:
        if self._overflowed:
            return
        hashes = list(hashes)
        if self._size + len(hashes) > self.capacity:
            # Keeping part of the history would mislead the consumer; it rebuilds from a snapshot.
            self._kinds.clear()
            self._hashes.clear()
            self._size = 0
            self._overflowed = True
            return
        if self._kinds and self._kinds[-1] == kind and kind != CLEARED:
            self._hashes[-1].extend(hashes)
        else:
            self._kinds.append(kind)
            self._hashes.append(hashes)
        self._size += len(hashes)

    def stored(self, block_hash: BlockHash) -> None:
        self._add(STORED, (block_hash,))

    def removed(self, block_hash: BlockHash) -> None:
        self._add(REMOVED, (block_hash,))

    def pinned(self, hashes: Iterable[BlockHash]) -> None:
        self._add(PINNED, hashes)

    def cleared(self) -> None:
        # Whatever was logged before a clear no longer matters to anyone who applies the clear.
        self._kinds.clear()
        self._hashes.clear()
        self._size = 0
        self._overflowed = False
        self._add(CLEARED, ())

    def drain(self) -> KVEventBatch:
        batch = KVEventBatch(tuple(KVEvent(k, tuple(h)) for k, h in zip(self._kinds, self._hashes)),
                             self._overflowed)
        self.restart()
        return batch

    def restart(self) -> None:
        """Forgets everything logged: called when a snapshot is taken, which supersedes it."""
        self._kinds.clear()
        self._hashes.clear()
        self._size = 0
        self._overflowed = False
