"""The registry of named cached contents (see cached_contents.py for the API)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from prefixserve.engine.async_llm import AsyncLLM
from prefixserve.entrypoints.server.cache_control import Conversation
from prefixserve.entrypoints.server.errors import APIError
from prefixserve.kv import PinInfo


@dataclass
class CachedContent:
    id: str
    name: Optional[str]
    model: str
    conversation: Conversation
    token_ids: list[int]
    cache_salt: Optional[str]
    pin_id: str
    created: int

    def describe(self, pin: PinInfo, to_unix) -> dict[str, Any]:
        return {
            "id": self.id, "object": "cached_content", "name": self.name, "model": self.model,
            "created": self.created,
            "expire_time": None if pin.expires_at is None else to_unix(pin.expires_at),
            "usage": {"total_tokens": len(self.token_ids), "cached_tokens": pin.num_tokens},
        }


class CachedContentRegistry:
    """The server's cached contents by id (names are unique among live ones)."""

    def __init__(self) -> None:
        self._by_id: dict[str, CachedContent] = {}

    async def live(self, async_llm: AsyncLLM) -> list[tuple[CachedContent, PinInfo]]:
        """Live contents with their pins; forgets the ones whose pin is gone."""
        pins = await async_llm.run_in_engine(lambda e: {p.pin_id: p for p in e.kv.pins()})
        alive = []
        for cid, content in list(self._by_id.items()):
            if content.pin_id in pins:
                alive.append((content, pins[content.pin_id]))
            else:
                del self._by_id[cid]
        return alive

    async def find(self, async_llm: AsyncLLM, key: str, param: str = "cached_content"
                   ) -> tuple[CachedContent, PinInfo]:
        for content, pin in await self.live(async_llm):
            if key in (content.id, content.name):
                return content, pin
        raise APIError(404, f"no cached content {key!r} (it may have expired or been deleted)",
                       type="not_found_error", param=param, code="cached_content_not_found")

    def add(self, content: CachedContent) -> None:
        self._by_id[content.id] = content

    def remove(self, content: CachedContent) -> bool:
        """Forgets content; True if no other content shares its pin (so it may be released)."""
        self._by_id.pop(content.id, None)
        return all(c.pin_id != content.pin_id for c in self._by_id.values())
