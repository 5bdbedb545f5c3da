"""`redis://host:6379/0`: a Redis server shared by processes and machines (redis-py).

Every call runs under a short socket timeout (`?timeout=` seconds, 0.5 by default): a slow or
dead server costs a miss, never a stalled engine.
"""
from __future__ import annotations

from typing import Iterator, Optional, Sequence

from prefixserve.kv.stores.base import KVStore, RecordParts, StoreError
from prefixserve.kv.stores.url import StoreSpec

KEY_PREFIX = "prefixserve:kv:"


class RedisStore(KVStore):
    persistent = True
    remote = True

    def __init__(self, spec: StoreSpec) -> None:
        super().__init__(spec)
        if spec.redis_url is None:
            raise ValueError(f"a redis store needs a redis:// URL: {spec.display}")
        import redis
        self._errors = (redis.RedisError, OSError)
        self._client = redis.Redis.from_url(spec.redis_url, socket_timeout=spec.timeout_s,
                                            socket_connect_timeout=spec.timeout_s,
                                            retry_on_timeout=False)

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except self._errors as exc:
            raise StoreError(f"redis {self.display}: {type(exc).__name__}: {exc}") from None

    def get(self, key: str) -> Optional[bytes]:
        return self._call(self._client.get, KEY_PREFIX + key)

    def contains(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []

        def run():
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(KEY_PREFIX + k)
            return [bool(n) for n in pipe.execute()]
        return self._call(run)

    def put(self, key: str, parts: RecordParts, spill: bool = False) -> list[tuple[str, bytes]]:
        self._call(self._client.set, KEY_PREFIX + key, b"".join(parts))
        return []

    def delete(self, key: str) -> None:
        self._call(self._client.delete, KEY_PREFIX + key)

    def scan(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        def run():
            keys = list(self._client.scan_iter(match=KEY_PREFIX + prefix + "*", count=1000))
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.strlen(k)
            sizes = pipe.execute() if keys else []
            return [(k.decode()[len(KEY_PREFIX):], n) for k, n in zip(keys, sizes) if n]
        return iter(self._call(run))

    def usage(self) -> tuple[int, int]:
        items = list(self.scan())
        return len(items), sum(n for _, n in items)

    def close(self) -> None:
        try:
            self._client.close()
        except self._errors:
            pass
