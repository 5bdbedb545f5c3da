"""Looking into and emptying a KV store from outside an engine (`prefixserve kv-store`)."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

from prefixserve.kv.stores import KVStore, StoreError, open_store, parse_store_url


@dataclass(frozen=True)
class ScopeUsage:
    scope: str      # the key scope's digest (one per weights, dtype, block size, layout, ...)
    records: int
    bytes: int


def _open(url: str) -> KVStore:
    spec = parse_store_url(url)
    if spec.scheme == "mem":
        raise ValueError("a mem:// store lives inside one engine process; inspect it through "
                         "that engine's stats or /metrics")
    try:
        return open_store(spec)
    except StoreError as exc:
        raise ValueError(str(exc)) from None


def _prefix(scope: Optional[str]) -> str:
    if scope is None:
        return ""
    if not scope or any(c not in "0123456789abcdef" for c in scope):
        raise ValueError(f"a scope is a lowercase hex digest, got {scope!r}")
    return scope + "/"


def store_usage(url: str) -> list[ScopeUsage]:
    store = _open(url)
    try:
        per: defaultdict[str, list[int]] = defaultdict(lambda: [0, 0])   # scope -> [records, bytes]
        for key, size in store.scan():
            entry = per[key.split("/", 1)[0]]
            entry[0] += 1
            entry[1] += size
        return [ScopeUsage(s, n, b) for s, (n, b) in sorted(per.items())]
    except StoreError as exc:
        raise ValueError(str(exc)) from None
    finally:
        store.close()


def store_records(url: str, scope: Optional[str] = None) -> list[tuple[str, int]]:
    """(key, bytes) of every record, or those of one scope; keys are scope/block-hash."""
    store = _open(url)
    try:
        return sorted(store.scan(_prefix(scope)))
    except StoreError as exc:
        raise ValueError(str(exc)) from None
    finally:
        store.close()


def clear_store(url: str, scope: Optional[str] = None) -> int:
    """Deletes every record (or those of one scope); returns how many."""
    store = _open(url)
    try:
        return store.clear(_prefix(scope))
    except StoreError as exc:
        raise ValueError(str(exc)) from None
    finally:
        store.close()
