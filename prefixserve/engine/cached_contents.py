"""Named cached contents: prompt prefixes computed once and kept pinned under an id and a name.

The store lives in the engine and is only touched on the engine's thread, so creating, using,
re-pinning and deleting contents are each one atomic step with respect to the pins they
hold. A content is registered in the same engine call that places its pin (see
`CachePin.content`), so no other call can release that pin in between.

Identical contents (same tokens, same salt) share one KV pin: the pin is released when the
last content holding it is deleted. The KV manager's pins are the truth about liveness: when a
pin goes (expired, or dropped by a cache reset) the manager says so and its contents go too.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

from prefixserve.errors import CachedContentLimitError, ConflictError, NotFoundError


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
    # Who may see and use it (the entry point's cache namespace); None: everyone.
    owner: Optional[str] = None
    pin_id: Optional[str] = None
    # Whose maximum of contents it counts against (the entry point's tenant; None: the one
    # tenant of an engine used without tenants).
    tenant: Optional[str] = None


class CachedContentStore:
    """Indexed by id, by scope and name, by pin and by tenant, so that no operation of one tenant
    walks another's contents, and each tenant holds at most max_per_tenant of them: identical
    contents share one pin, so without that cap one tenant could register contents without end
    (each keeps its tokens and conversation) and run every tenant's server out of memory."""

    def __init__(self, max_per_tenant: Optional[int] = None) -> None:
        if max_per_tenant is not None and (isinstance(max_per_tenant, bool) or not isinstance(max_per_tenant, int)
                                           or max_per_tenant < 1):
            raise ValueError(f"max_per_tenant must be None or a positive int, got {max_per_tenant!r}")
        self.max_per_tenant = max_per_tenant
        self._by_id: dict[str, CachedContent] = {}
        self._scopes: dict[Optional[str], dict[str, CachedContent]] = {}   # owner -> id -> content
        self._names: dict[tuple[Optional[str], str], str] = {}             # (owner, name) -> id
        self._by_pin: dict[str, set[str]] = {}
        self._per_tenant: Counter = Counter()

    def __len__(self) -> int:
        return len(self._by_id)

    def count(self, tenant: Optional[str]) -> int:
        return self._per_tenant[tenant]

    def check_new(self, content: CachedContent) -> None:
        """Whether content may be added: ConflictError when its name is live in its owner's
        scope, CachedContentLimitError when its tenant holds its maximum of contents."""
        if content.name is not None and self.name_taken(content.name, content.owner):
            raise ConflictError(f"a cached content named {content.name!r} already exists",
                                param="name", code="name_taken")
        if self.max_per_tenant is not None and self.count(content.tenant) >= self.max_per_tenant:
            raise CachedContentLimitError(
                f"this tenant holds {self.count(content.tenant)} cached contents, the most each tenant "
                f"may hold; delete one first")

    def add(self, content: CachedContent) -> None:
        """Registers a content whose pin was just placed, once check_new passed in the same
        engine call."""
        if content.pin_id is None:
            raise ValueError("a cached content needs the id of the pin that holds it")
        self.check_new(content)
        self._by_id[content.id] = content
        self._scopes.setdefault(content.owner, {})[content.id] = content
        if content.name is not None:
            self._names[(content.owner, content.name)] = content.id
        self._by_pin.setdefault(content.pin_id, set()).add(content.id)
        self._per_tenant[content.tenant] += 1

    def name_taken(self, name: str, owner: Optional[str]) -> bool:
        """A live content of this owner has this name (or id)."""
        return (owner, name) in self._names or name in self._scopes.get(owner, ())

    def visible(self, owner: Optional[str]) -> list[CachedContent]:
        return list(self._scopes.get(owner, {}).values())

    def find(self, key: str, owner: Optional[str], param: str = "cached_content") -> CachedContent:
        """The live content with this id or name in the owner's scope, else NotFoundError."""
        scope = self._scopes.get(owner, {})
        content = scope.get(key) or scope.get(self._names.get((owner, key), ""))
        if content is None:
            raise NotFoundError(f"no cached content {key!r} (it may have expired or been deleted)",
                                param=param, code="cached_content_not_found")
        return content

    def holds(self, pin_id: str) -> bool:
        """Some registered content holds this pin."""
        return pin_id in self._by_pin

    def remove(self, content: CachedContent) -> bool:
        """Forgets content; True if no other content shares its pin (so the pin may be released)."""
        if self._by_id.pop(content.id, None) is None:
            return content.pin_id not in self._by_pin
        # held, so add() saw its pin id
        assert content.pin_id is not None
        scope = self._scopes[content.owner]
        del scope[content.id]
        if not scope:
            del self._scopes[content.owner]
        if content.name is not None:
            del self._names[(content.owner, content.name)]
        self._per_tenant[content.tenant] -= 1
        if not self._per_tenant[content.tenant]:
            del self._per_tenant[content.tenant]
        sharing = self._by_pin[content.pin_id]
        sharing.discard(content.id)
        if sharing:
            return False
        del self._by_pin[content.pin_id]
        return True

    def pin_removed(self, pin_id: str) -> None:
        """The pin went (unpinned, expired, reset): so do the contents it held."""
        for cid in list(self._by_pin.get(pin_id, ())):
            self.remove(self._by_id[cid])
