"""Named cached contents: prompt prefixes computed once and kept pinned under an id and a name.

The store lives in the engine and is only touched on the engine's thread, so creating, using,
re-pinning and deleting contents are each one atomic step with respect to the pins they
hold. A content is registered in the same engine call that places its pin (see
`CachePin.content`), so no other call can release that pin in between.

Identical contents (same tokens, same salt) share one KV pin: the pin is released when the
last content holding it is deleted. The KV manager's pins are the truth about liveness: a
content whose pin expired (or was dropped by a cache reset) is gone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from prefixserve.errors import ConflictError, NotFoundError


@dataclass
class CachedContent:
    id: str
    name: Optional[str]
    token_ids: list[int]
    cache_salt: Optional[str]
    created: int
    # What the entry point needs to use the content again (the server keeps the conversation
    # that rendered to token_ids); the engine never looks inside.
    payload: Any = None
    # Who may see and use it (the entry point's tenant); None: everyone.
    owner: Optional[str] = None
    pin_id: Optional[str] = None


class CachedContentStore:
    def __init__(self) -> None:
        self._by_id: dict[str, CachedContent] = {}

    def add(self, content: CachedContent, live_pins: set[str]) -> None:
        """Registers a content whose pin was just placed; a live name in the owner's scope
        is refused (ConflictError)."""
        if content.pin_id is None:
            raise ValueError("a cached content needs the id of the pin that holds it")
        if content.name is not None and self.name_taken(content.name, content.owner, live_pins):
            raise ConflictError(f"a cached content named {content.name!r} already exists",
                                param="name", code="name_taken")
        self._by_id[content.id] = content

    def name_taken(self, name: str, owner: Optional[str], live_pins: set[str]) -> bool:
        """A live content of this owner has this name (or id)."""
        self.prune(live_pins)
        return any(c.owner == owner and name in (c.id, c.name) for c in self._by_id.values())

    def prune(self, live_pins: set[str]) -> None:
        """Forgets contents whose pin is gone."""
        for cid in [cid for cid, c in self._by_id.items() if c.pin_id not in live_pins]:
            del self._by_id[cid]

    def visible(self, owner: Optional[str], live_pins: set[str]) -> list[CachedContent]:
        self.prune(live_pins)
        return [c for c in self._by_id.values() if c.owner == owner]

    def find(self, key: str, owner: Optional[str], live_pins: set[str],
             param: str = "cached_content") -> CachedContent:
        """The live content with this id or name in the owner's scope, else NotFoundError."""
        for content in self.visible(owner, live_pins):
            if key in (content.id, content.name):
                return content
        raise NotFoundError(f"no cached content {key!r} (it may have expired or been deleted)",
                            param=param, code="cached_content_not_found")

    def holds(self, pin_id: str) -> bool:
        """Some registered content holds this pin."""
        return any(c.pin_id == pin_id for c in self._by_id.values())

    def remove(self, content: CachedContent) -> bool:
        """Forgets content; True if no other content shares its pin (so the pin may be released)."""
        self._by_id.pop(content.id, None)
        return all(c.pin_id != content.pin_id for c in self._by_id.values())
