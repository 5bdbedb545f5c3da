"""KV stores beneath the pool: host memory, local files and Redis, fastest first.

`kv` decides what to look up, what to write and what a loaded block must match; the worker
moves the bytes between the pool and a store; a store client knows keys and bytes only.
docs/kv-stores.md describes the guarantees.
"""
from prefixserve.kv.stores.base import KVStore, StoreError
from prefixserve.kv.stores.chain import StoreChain
from prefixserve.kv.stores.record import BlockMeta, RecordError
from prefixserve.kv.stores.scope import FORMAT_VERSION, KeyScope
from prefixserve.kv.stores.stats import KVStoreStats
from prefixserve.kv.stores.url import StoreSpec, parse_size, parse_store_url
from prefixserve.kv.stores.writer import BackgroundWriter


def open_store(url_or_spec) -> KVStore:
    """A store client for a URL (or a parsed StoreSpec)."""
    spec = url_or_spec if isinstance(url_or_spec, StoreSpec) else parse_store_url(url_or_spec)
    if spec.scheme == "mem":
        from prefixserve.kv.stores.mem import MemStore
        return MemStore(spec)
    if spec.scheme == "file":
        from prefixserve.kv.stores.file import FileStore
        return FileStore(spec)
    from prefixserve.kv.stores.redis_store import RedisStore
    return RedisStore(spec)


__all__ = ["BackgroundWriter", "BlockMeta", "FORMAT_VERSION", "KVStore", "KVStoreStats",
           "KeyScope", "RecordError", "StoreChain", "StoreError", "StoreSpec", "open_store",
           "parse_size", "parse_store_url"]
