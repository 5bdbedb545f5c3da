"""Explicit cache control: pins on prompt prefixes and the named cached contents they hold.

Runs on the engine's thread like everything that touches the KV manager, so each call is one
atomic step with respect to the pins it reads or places. The KV manager's pins are the truth:
each call first lets expired pins go, which drops their contents, then reads the pins of the
contents left (none can expire in between).
"""
from __future__ import annotations

from typing import Optional, Sequence

from prefixserve.engine.cached_contents import CachedContent, CachedContentStore
from prefixserve.engine.outputs import PinInfo, PinResult
from prefixserve.engine.sample_groups import Group
from prefixserve.errors import CachedContentLimitError, ConflictError, NotFoundError, PinLimitError
from prefixserve.kv import KVCacheManager
from prefixserve.kv import PinInfo as KVPinInfo


def public_pin(info: KVPinInfo) -> PinInfo:
    return PinInfo(info.pin_id, info.num_tokens, info.expires_at)


class CacheControl:
    def __init__(self, kv: KVCacheManager, contents: CachedContentStore) -> None:
        self.kv = kv
        self.contents = contents
        kv.watch_pin_removals(contents.pin_removed)

    def reset_prefix_cache(self) -> int:
        """Drops every pin, every cached content and every cached hash; returns the hashes dropped."""
        return self.kv.reset_prefix_cache()

    def pin_prefix(self, token_ids: Sequence[int], *, cache_salt: Optional[str] = None,
                   num_tokens: Optional[int] = None, ttl_s: Optional[float] = None,
                   shorten: bool = False, tenant: Optional[str] = None) -> PinInfo:
        """Pins the cached full blocks of the prompt's first num_tokens tokens for ttl_s seconds
        (refreshing a pin that holds them already; shorten lets the expiry move earlier).
        Raises PinLimitError beyond the pinned-block cap, or beyond tenant's share of it."""
        return public_pin(self.kv.pin_prefix(token_ids, cache_salt=cache_salt, num_tokens=num_tokens,
                                             ttl_s=ttl_s, shorten=shorten, tenant=tenant))

    def unpin(self, pin_id: str) -> bool:
        """Releases a pin; False if it no longer lives. A pin a cached content holds is released
        by deleting the content instead."""
        if self.contents.holds(pin_id):
            raise ConflictError(f"pin {pin_id!r} holds a cached content; delete the content instead",
                                param="pin_id", code="pin_in_use")
        return self.kv.unpin(pin_id)

    def list_pins(self) -> list[PinInfo]:
        return [public_pin(p) for p in self.kv.pins()]

    def apply_pins(self, group: Group) -> None:
        """Places the pins a request asked for, once its prompt is computed; each pin's result
        (or why it was refused) goes to group.pin_results."""
        # The prompt's blocks were registered when allocated and are held by the
        # request now, so the whole prefix is found in the cache; the partial blocks of exact
        # breakpoints are registered once computed, which the prompt now is.
        if any(pin.exact for pin in group.cache_pins):
            self.kv.cache_reached_breakpoints(group.request_id)
        for pin in group.cache_pins:
            try:
                if pin.content is not None:
                    # refused before anything is pinned for it, so a refusal never leaves a pin
                    # (after the expired pins, and with them their contents, have gone)
                    self.kv.expire_pins()
                    self.contents.check_new(pin.content)
                info = self.kv.pin_prefix(group.prompt_token_ids, cache_salt=group.cache_salt,
                                          num_tokens=pin.num_tokens, ttl_s=pin.ttl_s, tenant=pin.tenant,
                                          exact=pin.exact)
                if pin.content is not None and info.pin_id is not None:
                    pin.content.pin_id = info.pin_id
                    self.contents.add(pin.content)
            except (PinLimitError, ConflictError, CachedContentLimitError) as exc:
                group.pin_results.append(PinResult(pin.num_tokens, 0, None, str(exc), error_code=exc.code))
                continue
            group.pin_results.append(PinResult(pin.num_tokens, info.num_tokens, info.expires_at,
                                               None, info.pin_id))

    # ------------------------------------------------------- cached contents
    def _content_pin(self, content: CachedContent) -> PinInfo:
        # A stored content always holds a live pin: the store takes none without one, and a
        # pin's removal removes its contents.
        pin = self.kv.pin(content.pin_id) if content.pin_id is not None else None
        assert pin is not None, f"cached content {content.id!r} outlived its pin"
        return public_pin(pin)

    def cached_contents(self, owner: Optional[str] = None) -> list[tuple[CachedContent, PinInfo]]:
        """The live contents visible to owner, each with its pin."""
        self.kv.expire_pins()
        return [(c, self._content_pin(c)) for c in self.contents.visible(owner)]

    def find_cached_content(self, key: str, owner: Optional[str] = None,
                            param: str = "cached_content") -> tuple[CachedContent, PinInfo]:
        """The live content named or identified by key in owner's scope; NotFoundError otherwise."""
        self.kv.expire_pins()
        content = self.contents.find(key, owner, param=param)
        return content, self._content_pin(content)

    def cached_content_name_taken(self, name: str, owner: Optional[str] = None) -> bool:
        self.kv.expire_pins()
        return self.contents.name_taken(name, owner)

    def repin_cached_content(self, key: str, ttl_s: float, owner: Optional[str] = None,
                             param: str = "key") -> tuple[CachedContent, PinInfo]:
        """Sets a content's expiry to ttl_s from now, shorter as well as longer."""
        content, _ = self.find_cached_content(key, owner, param=param)
        info = self.kv.pin_prefix(content.token_ids, cache_salt=content.cache_salt,
                                  num_tokens=len(content.token_ids), ttl_s=ttl_s, shorten=True,
                                  tenant=content.tenant)
        if info.pin_id != content.pin_id:
            # The content's own pin holds these blocks, so the walk finds exactly them again
            # unless that pin expired in between: then the pin just placed holds nothing's.
            if info.pin_id is not None:
                self.kv.unpin(info.pin_id)
            raise NotFoundError(f"cached content {key!r} is no longer in the cache", param=param,
                                code="cached_content_not_found")
        return content, public_pin(info)

    def delete_cached_content(self, key: str, owner: Optional[str] = None,
                              param: str = "key") -> CachedContent:
        """Forgets a content and releases its pin unless another content shares it."""
        content, _ = self.find_cached_content(key, owner, param=param)
        if self.contents.remove(content):
            self.kv.unpin(content.pin_id)
        return content
