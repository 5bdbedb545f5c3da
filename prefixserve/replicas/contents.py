"""Cached contents across replicas: the front's directory of what each content is and where it
lives.

A content lives in one engine: the replica the router picked for its tokens when it was
created (so later requests that start with those tokens are routed there by the same rule).
The front keeps each content's whole definition (tokens, salt, owner, name, tenant, the
server's payload) and its placement, so that get, list, re-pin and delete go to that replica,
names stay unique per owner and the per-tenant maximum holds across all replicas, and a
content whose replica died is created again wherever the router now picks.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional

from prefixserve.engine import CachedContent
from prefixserve.engine.cached_contents import CachedContentStore
from prefixserve.errors import CachedContentLimitError, ConflictError


@dataclass
class Placement:
    replica: str                 # Ray Serve's replica id
    expires_at: Optional[float]  # when its pin expires, on the engines' clock; None: never


class ContentDirectory:
    def __init__(self, max_per_tenant: Optional[int] = None) -> None:
        self._store = CachedContentStore(max_per_tenant)
        self._where: dict[str, tuple[CachedContent, Placement]] = {}   # by content id
        # Contents on their way to a replica: their names and counts are taken already.
        self._reserved: set[tuple[Optional[str], str]] = set()
        self._reserved_per_tenant: Counter = Counter()

    def __len__(self) -> int:
        return len(self._where)

    def expire(self, now: float) -> None:
        """Forgets contents whose pin has expired (their replica dropped them)."""
        for content, placement in list(self._where.values()):
            if placement.expires_at is not None and placement.expires_at <= now:
                self.remove(content)

    def reserve(self, content: CachedContent) -> None:
        """Takes content's name and a place in its tenant's count before it is sent to a
        replica: ConflictError or CachedContentLimitError when it may not be created."""
        self._store.check_new(content)
        key = (content.owner, content.name or content.id)
        if key in self._reserved:
            raise ConflictError(f"a cached content named {content.name!r} already exists",
                                param="name", code="name_taken")
        limit = self._store.max_per_tenant
        if limit is not None and \
                self._store.count(content.tenant) + self._reserved_per_tenant[content.tenant] >= limit:
            raise CachedContentLimitError(
                f"this tenant holds {limit} cached contents, the most each tenant may hold; "
                "delete one first")
        self._reserved.add(key)
        self._reserved_per_tenant[content.tenant] += 1

    def release(self, content: CachedContent) -> None:
        self._reserved.discard((content.owner, content.name or content.id))
        self._reserved_per_tenant[content.tenant] -= 1
        if self._reserved_per_tenant[content.tenant] <= 0:
            del self._reserved_per_tenant[content.tenant]

    def add(self, content: CachedContent, placement: Placement) -> None:
        # The store indexes contents by pin: a pin id names a pin within one replica only.
        content.pin_id = f"{placement.replica}/{content.id}"
        self._store.add(content)
        self._where[content.id] = (content, placement)

    def place(self, content: CachedContent, placement: Placement) -> None:
        self._where[content.id] = (content, placement)

    def placement(self, content: CachedContent) -> Placement:
        return self._where[content.id][1]

    def holds(self, content: CachedContent) -> bool:
        return content.id in self._where

    def find(self, key: str, owner: Optional[str], param: str) -> CachedContent:
        return self._store.find(key, owner, param=param)

    def visible(self, owner: Optional[str]) -> list[CachedContent]:
        return self._store.visible(owner)

    def name_taken(self, name: str, owner: Optional[str]) -> bool:
        return self._store.name_taken(name, owner) or (owner, name) in self._reserved

    def remove(self, content: CachedContent) -> None:
        self._store.remove(content)
        self._where.pop(content.id, None)

    def clear(self) -> None:
        for content, _ in list(self._where.values()):
            self.remove(content)
