"""Stored responses of /v1/responses: each response's full item list, its response object and
the exact tokens of its turn, per tenant, so `previous_response_id` continues the conversation
(and renders it into the tokens it was generated as).

Where it lives is a URL, like the KV stores': `mem://` (this process, the default),
`file:///dir` (one JSON file per response under a directory per tenant: responses survive a
restart and replicas on one machine share them) or `redis://host:6379/0` (shared by every
replica). Each tenant is bounded on its own, in responses and bytes: storing past either bound
drops that tenant's oldest responses, never another tenant's. Every response expires `ttl_s`
after it was stored. A tenant's responses live under a digest of its name, so no id of one
tenant can be read, listed or deleted under another; an id that is not one this server makes
(`resp_` and 32 hex digits) is simply not found, and never reaches a path or a key.

A store that cannot be reached raises ResponseStoreUnavailable: each backend names the
exceptions that mean its store is down rather than wrong (Redis refusing or timing out, a file
store's I/O failing), so the HTTP layer answers them as a 503 to retry, and anything else (a
corrupt record, a bug) stays an internal error.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Protocol
from urllib.parse import urlsplit

RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")
REDIS_PREFIX = "prefixserve:responses:"


def tenant_key(tenant: Optional[str]) -> str:
    return hashlib.sha256(json.dumps(["tenant", tenant]).encode()).hexdigest()[:32]


class ResponseStoreUnavailable(Exception):
    """The store could not be reached; its message is the backend's cause, for the log only
    (a client is told no more than that the store is unavailable: a URL can hold a password)."""


class Backend(Protocol):
    """Bytes under (tenant key, response id), oldest first in `entries`. `outages`: what its
    methods raise when the store is unreachable, as opposed to wrong."""
    outages: tuple[type[BaseException], ...]

    def put(self, tenant: str, rid: str, data: bytes, now: float) -> None: ...
    def get(self, tenant: str, rid: str) -> Optional[bytes]: ...
    def delete(self, tenant: str, rid: str) -> bool: ...
    def entries(self, tenant: str) -> list[tuple[str, int, float]]: ...  # (id, bytes, stored at)


class MemoryBackend:
    outages: tuple[type[BaseException], ...] = ()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tenants: dict[str, OrderedDict[str, tuple[bytes, float]]] = {}

    def put(self, tenant: str, rid: str, data: bytes, now: float) -> None:
        with self._lock:
            self._tenants.setdefault(tenant, OrderedDict())[rid] = (data, now)

    def get(self, tenant: str, rid: str) -> Optional[bytes]:
        with self._lock:
            entry = self._tenants.get(tenant, {}).get(rid)
        return entry[0] if entry is not None else None

    def delete(self, tenant: str, rid: str) -> bool:
        with self._lock:
            return self._tenants.get(tenant, {}).pop(rid, None) is not None

    def entries(self, tenant: str) -> list[tuple[str, int, float]]:
        with self._lock:
            return [(rid, len(data), at) for rid, (data, at) in self._tenants.get(tenant, {}).items()]


class FileBackend:
    """DIR/<tenant key>/<id>.json, written to a temporary file and renamed into place (a reader
    or a crash never sees half a response); a file's mtime is when it was stored. Any OSError
    but a missing response's is an outage: an unmounted or failing volume, a full disk, lost
    permissions."""

    outages: tuple[type[BaseException], ...] = (OSError,)

    def __init__(self, root: str) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)

    def _path(self, tenant: str, rid: str) -> Path:
        return self.root / tenant / f"{rid}.json"

    def put(self, tenant: str, rid: str, data: bytes, now: float) -> None:
        folder = self.root / tenant
        folder.mkdir(exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.utime(tmp, (now, now))
            os.replace(tmp, self._path(tenant, rid))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def get(self, tenant: str, rid: str) -> Optional[bytes]:
        try:
            return self._path(tenant, rid).read_bytes()
        except FileNotFoundError:
            return None

    def delete(self, tenant: str, rid: str) -> bool:
        try:
            self._path(tenant, rid).unlink()
            return True
        except FileNotFoundError:
            return False

    def entries(self, tenant: str) -> list[tuple[str, int, float]]:
        found = []
        folder = self.root / tenant
        if not folder.is_dir():
            return []
        for entry in os.scandir(folder):
            if entry.name.endswith(".json") and not entry.name.startswith("."):
                try:
                    stat = entry.stat()
                except FileNotFoundError:  # deleted by another replica meanwhile
                    continue
                found.append((entry.name[:-5], stat.st_size, stat.st_mtime))
        return sorted(found, key=lambda e: e[2])


class RedisBackend:
    """One key per response (expiring by itself) and a sorted set per tenant of its ids by the
    time they were stored; ids whose key has expired leave the set when the tenant next stores."""

    outages: tuple[type[BaseException], ...]

    def __init__(self, url: str, ttl_s: float) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # One retry, at once: a connection Redis dropped (at its restart) is replaced, and a Redis
        # that is down fails the request now (a 503 with Retry-After) instead of after seconds
        # of the client's backoff, which would hold the request and a worker thread meanwhile.
        once = Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))
        self._client = redis.Redis.from_url(url, socket_timeout=5.0, socket_connect_timeout=5.0, retry=once,
                                            retry_on_error=[redis.ConnectionError])
        # refused, reset, timed out, still loading its data, refusing our credentials: down, not
        # wrong (an error Redis answers, such as a key of the wrong type, is no outage)
        self.outages = (redis.ConnectionError, redis.TimeoutError)
        self._ttl_ms = max(1, int(ttl_s * 1000))

    def _key(self, tenant: str, rid: str) -> str:
        return f"{REDIS_PREFIX}{tenant}:{rid}"

    def _index(self, tenant: str) -> str:
        return f"{REDIS_PREFIX}{tenant}:index"

    def put(self, tenant: str, rid: str, data: bytes, now: float) -> None:
        pipe = self._client.pipeline()
        pipe.set(self._key(tenant, rid), data, px=self._ttl_ms)
        pipe.zadd(self._index(tenant), {rid: now})
        pipe.execute()

    def get(self, tenant: str, rid: str) -> Optional[bytes]:
        return self._client.get(self._key(tenant, rid))

    def delete(self, tenant: str, rid: str) -> bool:
        pipe = self._client.pipeline()
        pipe.delete(self._key(tenant, rid))
        pipe.zrem(self._index(tenant), rid)
        return bool(pipe.execute()[0])

    def entries(self, tenant: str) -> list[tuple[str, int, float]]:
        ids = [(rid.decode(), at) for rid, at in self._client.zrange(self._index(tenant), 0, -1, withscores=True)]
        pipe = self._client.pipeline()
        for rid, _ in ids:
            pipe.strlen(self._key(tenant, rid))
        sizes = pipe.execute() if ids else []
        gone = [rid for (rid, _), size in zip(ids, sizes) if not size]
        if gone:
            self._client.zrem(self._index(tenant), *gone)
        return [(rid, size, at) for (rid, at), size in zip(ids, sizes) if size]


@dataclass(frozen=True)
class StoreBounds:
    ttl_s: float
    max_responses: int      # per tenant
    max_bytes: int          # per tenant


class ResponseStore:
    """Stored responses as JSON objects, per tenant, within the bounds."""

    def __init__(self, backend: Backend, bounds: StoreBounds, url: str = "mem://",
                 clock: Callable[[], float] = time.time) -> None:
        self.backend, self.bounds, self.url, self.clock = backend, bounds, url, clock

    @classmethod
    def open(cls, url: Optional[str], bounds: StoreBounds) -> ResponseStore:
        url = url or "mem://"
        parts = urlsplit(url)
        if parts.scheme == "mem":
            return cls(MemoryBackend(), bounds, url)
        if parts.scheme == "file":
            if parts.netloc not in ("", "localhost") or not parts.path:
                raise ValueError(f"a file response store needs file:///absolute/dir, got {url!r}")
            return cls(FileBackend(parts.path), bounds, url)
        if parts.scheme in ("redis", "rediss"):
            return cls(RedisBackend(url, bounds.ttl_s), bounds, url)
        raise ValueError(f"--response-store must be a mem://, file:/// or redis:// URL, got {url!r}")

    @contextmanager
    def _reaching(self) -> Iterator[None]:
        try:
            yield
        except self.backend.outages as exc:
            raise ResponseStoreUnavailable(f"{type(exc).__name__}: {exc}") from exc

    def put(self, tenant: Optional[str], record: dict[str, Any]) -> bool:
        """Stores `record` (its "id" a response id) as the tenant's newest; False when it alone
        is larger than a tenant may hold (then nothing is stored)."""
        key, now = tenant_key(tenant), self.clock()
        data = json.dumps({**record, "stored_at": now}, separators=(",", ":")).encode()
        if len(data) > self.bounds.max_bytes:
            return False
        with self._reaching():
            self.backend.put(key, record["id"], data, now)
            entries = self.backend.entries(key)
            total = sum(size for _, size, _ in entries)
            for rid, size, at in entries:  # oldest first
                expired = at + self.bounds.ttl_s <= now
                over = len(entries) > self.bounds.max_responses or total > self.bounds.max_bytes
                if rid == record["id"] or not (expired or over):
                    continue
                if self.backend.delete(key, rid):
                    total -= size
                entries = [e for e in entries if e[0] != rid]
        return True

    def get(self, tenant: Optional[str], rid: str) -> Optional[dict[str, Any]]:
        """The tenant's response `rid`, or None (unknown, expired, another tenant's)."""
        if not RESPONSE_ID.fullmatch(rid):
            return None
        with self._reaching():
            data = self.backend.get(tenant_key(tenant), rid)
            if data is None:
                return None
            record = json.loads(data)
            if record["stored_at"] + self.bounds.ttl_s <= self.clock():
                self.backend.delete(tenant_key(tenant), rid)
                return None
        return record

    def delete(self, tenant: Optional[str], rid: str) -> bool:
        if not RESPONSE_ID.fullmatch(rid):
            return False
        with self._reaching():
            return self.backend.delete(tenant_key(tenant), rid)

    def usage(self, tenant: Optional[str]) -> tuple[int, int]:
        """(responses, bytes) the tenant holds now."""
        with self._reaching():
            entries = self.backend.entries(tenant_key(tenant))
        return len(entries), sum(size for _, size, _ in entries)
