"""What every store client offers. A store knows keys and bytes, never tokens or requests."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Iterator, Optional, Sequence

from prefixserve.kv.stores.mac import RecordMac, load_mac
from prefixserve.kv.stores.url import StoreSpec

# (head, payload, checksum) as record.encode_parts returns them.
RecordParts = tuple


class StoreError(Exception):
    """The store could not answer (unreachable, disk full, I/O error): counted as a fault and
    served as a miss."""


class KVStore(ABC):
    persistent = False   # whether its records outlive the process
    remote = False       # whether counting its records costs a scan of a server

    def __init__(self, spec: StoreSpec) -> None:
        self.spec = spec
        # What seals its records: None, a checksum anyone can recompute.
        self.mac: Optional[RecordMac] = load_mac(spec.mac_key_file, spec.mac_key_env)

    @property
    def display(self) -> str:
        return self.spec.display

    @abstractmethod
    def get(self, key: str) -> Optional[bytes | bytearray]:
        """The record under key, None if absent."""

    def read_into(self, key: str, buffers: Sequence[memoryview]) -> Optional[int]:
        """Reads the record under key into `buffers`, filled one after the other, when its size
        is their total size (a record of any other size cannot be the one expected and is not
        read). Returns the record's size, None if absent. Stores that can read straight into
        the buffers override it; this one copies what get returns."""
        data = self.get(key)
        if data is None:
            return None
        view = memoryview(data).cast("B")
        if view.nbytes == sum(b.nbytes for b in buffers):
            pos = 0
            for b in buffers:
                b[:] = view[pos:pos + b.nbytes]
                pos += b.nbytes
        return view.nbytes

    @abstractmethod
    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is held; one round trip for the whole batch where the store is
        remote, so a router can cost a lookup cheaply."""

    @abstractmethod
    def put(self, key: str, parts: RecordParts, spill: bool = False) -> list[tuple[str, bytes]]:
        """Stores a record and makes room for it. Without spill, what it evicts is deleted. With
        spill, it returns the records chosen to make room (for the next store) and keeps
        them readable (no longer counted in its usage) until the caller deletes each one once
        it has moved it on: a lookup meanwhile finds a record on its way down in one store or
        the other, never in neither."""

    @abstractmethod
    def delete(self, key: str) -> None:
        ...

    @abstractmethod
    def scan(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        """(key, record size) of every record whose key starts with prefix."""

    def clear(self, prefix: str = "") -> int:
        """Deletes every record whose key starts with prefix; returns how many."""
        n = 0
        for key, _ in list(self.scan(prefix)):
            self.delete(key)
            n += 1
        return n

    @abstractmethod
    def usage(self) -> tuple[int, int]:
        """(records, bytes) held, as far as this process knows."""

    def close(self) -> None:
        """Releases connections and handles."""
