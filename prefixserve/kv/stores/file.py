"""`file:///dir?size=...`: one file per block under a directory per key scope.

The directory is indexed at start from names and sizes alone (no block is read), so a large
store opens fast. Files are written under a temporary name and renamed into place, so a
crash leaves either the whole record or none; a torn or altered file fails its checksum when
read and is deleted. Several processes may share a directory: one that misses its own index
looks at the disk before answering.

Records hold token ids in clear, so the store is private to the user running the engine,
whatever the umask: scope directories are created 0700 and records 0600, and a directory
that another user owns or can write (where they could plant, swap or read records) is
refused at start.
"""
from __future__ import annotations

import itertools
import logging
import os
import re
import stat
import threading
from collections import OrderedDict
from typing import Iterator, Optional, Sequence

from prefixserve.kv.stores.base import KVStore, RecordParts, StoreError
from prefixserve.kv.stores.url import StoreSpec

SUFFIX = ".kvb"
DIR_MODE = 0o700
RECORD_MODE = 0o600
_KEY = re.compile(r"([0-9a-f]{2,64})/([0-9a-f]{2,128})")
logger = logging.getLogger(__name__)


class FileStore(KVStore):
    persistent = True

    def __init__(self, spec: StoreSpec) -> None:
        super().__init__(spec)
        if spec.path is None:
            raise ValueError(f"a file store needs a directory: {spec.display}")
        self.root: str = spec.path
        self.capacity = spec.size
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()   # key -> size, oldest first
        self._bytes = 0
        # Evicted with spill and not yet deleted by the chain: on disk, no longer counted.
        self._leaving: set[str] = set()
        self._tmp_ids = itertools.count()
        try:
            _make_private_dir(self.root)
            _check_private(self.root)
            self._load_index()
        except OSError as exc:
            raise StoreError(f"cannot open file store {self.root}: {exc}") from None

    def _load_index(self) -> None:
        found = []
        with os.scandir(self.root) as scopes:
            for scope in scopes:
                if not scope.is_dir(follow_symlinks=False):
                    continue
                # One written by an older build may be 0755: closed now, before use.
                _check_private(scope.path)
                os.chmod(scope.path, DIR_MODE)
                with os.scandir(scope.path) as entries:
                    for e in entries:
                        if not e.name.endswith(SUFFIX):
                            continue
                        key = f"{scope.name}/{e.name[:-len(SUFFIX)]}"
                        if _KEY.fullmatch(key) and e.is_file(follow_symlinks=False):
                            st = e.stat(follow_symlinks=False)
                            found.append((st.st_mtime_ns, key, st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self._bytes += size

    def _path(self, key: str) -> str:
        m = _KEY.fullmatch(key)
        if m is None:
            raise ValueError(f"not a store key: {key!r}")
        return os.path.join(self.root, m.group(1), m.group(2) + SUFFIX)

    def get(self, key: str) -> Optional[bytearray]:
        # Read, not memory-mapped: a file truncated in place by someone else while mapped
        # would kill the process (SIGBUS) instead of failing its checksum.
        path = self._path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                n = f.readinto(data)
                if n != len(data):
                    del data[n:]
        except FileNotFoundError:
            self._forget(key)
            return None
        except OSError as exc:
            raise StoreError(f"reading {path}: {exc}") from None
        self._touch(key, len(data))
        return data

    def read_into(self, key: str, buffers: Sequence[memoryview]) -> Optional[int]:
        """One scattered read (preadv) straight into the buffers (the pool's memory), nothing
        staged. A file that shrinks while it is read comes back short and fails its checksum."""
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self._forget(key)
            return None
        except OSError as exc:
            raise StoreError(f"reading {path}: {exc}") from None
        try:
            size = os.fstat(fd).st_size
            if size == sum(b.nbytes for b in buffers):
                done = 0
                while done < size:
                    n = os.preadv(fd, _after(buffers, done), done)
                    if n == 0:
                        return done
                    done += n
        except OSError as exc:
            raise StoreError(f"reading {path}: {exc}") from None
        finally:
            os.close(fd)
        self._touch(key, size)
        return size

    def contains(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            held = [k in self._index or k in self._leaving for k in keys]
        for i, key in enumerate(keys):
            if not held[i]:
                # Written by another process since this one indexed the directory.
                held[i] = os.path.isfile(self._path(key))
        return held

    def put(self, key: str, parts: RecordParts, spill: bool = False) -> list[tuple[str, bytes]]:
        path = self._path(key)
        size = sum(memoryview(p).nbytes for p in parts)
        if self.capacity is not None and size > self.capacity:
            return []
        tmp = os.path.join(os.path.dirname(path),
                           f".tmp.{os.getpid()}.{threading.get_ident()}.{next(self._tmp_ids)}")
        try:
            _make_private_dir(os.path.dirname(path))
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, RECORD_MODE)
            with open(fd, "wb") as f:
                os.fchmod(fd, RECORD_MODE)   # the umask may have taken bits from it
                for p in parts:
                    f.write(p)
            os.replace(tmp, path)
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise StoreError(f"writing {path}: {exc}") from None
        victims = []
        with self._lock:
            old = self._index.pop(key, None)
            if old is not None:
                self._bytes -= old
            self._index[key] = size
            self._bytes += size
            while self.capacity is not None and self._bytes > self.capacity and len(self._index) > 1:
                k, s = self._index.popitem(last=False)
                self._bytes -= s
                victims.append(k)
                if spill:
                    self._leaving.add(k)
        evicted = []
        for k in victims:
            p = self._path(k)
            if spill:   # the caller deletes it once it has moved it on
                try:
                    with open(p, "rb") as f:
                        evicted.append((k, f.read()))
                    continue
                except OSError as exc:
                    logger.debug("reading %s to spill it: %s", p, exc)
                    self._forget(k)
            try:
                os.unlink(p)
            except OSError as exc:
                logger.debug("evicting %s: %s", p, exc)
        return evicted

    def _touch(self, key: str, size: int) -> None:
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
            else:
                self._index[key] = size
                self._bytes += size

    def _forget(self, key: str) -> None:
        with self._lock:
            self._leaving.discard(key)
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes -= size

    def delete(self, key: str) -> None:
        self._forget(key)
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise StoreError(f"deleting {key}: {exc}") from None

    def scan(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        with self._lock:
            items = [(k, s) for k, s in self._index.items() if k.startswith(prefix)]
        return iter(items)

    def usage(self) -> tuple[int, int]:
        with self._lock:
            return len(self._index), self._bytes


def _check_private(path: str) -> None:
    """Refuses a directory another user owns or can write into."""
    st = os.stat(path)
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise StoreError(f"file store {path} has mode {stat.S_IMODE(st.st_mode):04o}: other "
                         "users can write into it (plant, swap or delete records); use a "
                         "directory only this user can write (chmod 700)")
    if st.st_uid != os.geteuid():
        raise StoreError(f"file store {path} is owned by uid {st.st_uid}, not by this user "
                         f"(uid {os.geteuid()}): its owner could read and plant records")


def _make_private_dir(path: str) -> None:
    """Creates path and the parents it lacks, each 0700 whatever the umask (a parent others
    could write would let them move the store away and put their own in its place)."""
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path)
    if parent != path:
        _make_private_dir(parent)
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        return
    os.chmod(path, DIR_MODE)


def _after(buffers: Sequence[memoryview], offset: int) -> list[memoryview]:
    """The buffers from byte `offset` of their concatenation on (after a partial read)."""
    out = []
    for b in buffers:
        if offset >= b.nbytes:
            offset -= b.nbytes
            continue
        out.append(b[offset:])
        offset = 0
    return out
