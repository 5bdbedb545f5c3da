"""Named cached contents: a system prompt, tools and messages computed once and pinned.

POST /v1/cached_contents renders the content through the chat template (no generation
prompt), prefills it through the engine (max_tokens=1) and pins its whole rendered prefix
(every full block) for its TTL. A chat or Messages request naming it with `cached_content`
is rendered as the content's conversation followed by the request's messages; the server
checks that the rendered prompt's tokens start with the content's tokens (400 otherwise),
so the pinned blocks are a guaranteed hit.

The KV manager's pins are the truth about liveness: a content whose pin expired (or was
dropped by /reset_prefix_cache) is gone. Identical contents share one pin; it is released
when the last of them is deleted.
"""
from __future__ import annotations

import re
import time
from typing import Any, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import Field

from prefixserve.engine.outputs import CachePin
from prefixserve.entrypoints.server.cache_control import PromptRenderer
from prefixserve.entrypoints.server.cached_content_registry import CachedContent
from prefixserve.entrypoints.server.conversations import conversation_of
from prefixserve.entrypoints.server.errors import APIError, bad_request
from prefixserve.entrypoints.server.generation import submit
from prefixserve.entrypoints.server.protocol import StrictModel
from prefixserve.entrypoints.server.state import get_state, new_id
from prefixserve.entrypoints.server.usage import unix_time
from prefixserve.kv import PinInfo, PinLimitError
from prefixserve.sampling_params import SamplingParams

_TTL = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h)\s*$")
_UNIT_SECONDS = {"s": 1.0, "m": 60.0, "h": 3600.0}


class CachedContentCreate(StrictModel):
    model: Optional[str] = None
    name: Optional[str] = None
    system: Union[str, list[dict[str, Any]], None] = None
    messages: list[dict[str, Any]] = Field(default_factory=list)
    tools: Optional[list[dict[str, Any]]] = None
    ttl: Union[str, int, float] = "1h"
    cache_salt: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


class CachedContentUpdate(StrictModel):
    ttl: Union[str, int, float]


def parse_ttl(value: Union[str, int, float], scale: float) -> float:
    """Seconds of a TTL given as seconds or "300s" / "5m" / "1h", times the server's scale."""
    if isinstance(value, bool):
        raise bad_request(f"ttl must be seconds or a string like \"5m\", got {value!r}", param="ttl")
    if isinstance(value, str):
        match = _TTL.match(value)
        if match is None:
            raise bad_request(f"ttl must be seconds or a string like \"300s\", \"5m\" or \"1h\", "
                              f"got {value!r}", param="ttl")
        seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    else:
        seconds = float(value)
    if not seconds > 0:
        raise bad_request(f"ttl must be positive, got {value!r}", param="ttl")
    return seconds * scale


async def create_cached_content(body: CachedContentCreate, request: Request) -> JSONResponse:
    state = get_state(request)
    state.check_model(body.model)
    state.check_cache_salt(body.cache_salt)
    ttl_s = parse_ttl(body.ttl, state.config.cache_ttl_scale)
    conversation = conversation_of(body.system, body.messages, body.tools).unmarked()
    if not conversation.turns:
        raise bad_request("a cached content needs a system prompt or at least one message",
                          param="messages")
    renderer = PromptRenderer(state.async_llm.tokenizer, add_generation_prompt=False,
                              template_kwargs=body.chat_template_kwargs)
    try:
        token_ids = renderer.render(conversation).token_ids
    except ValueError as exc:
        raise bad_request(f"the chat template could not render this content: {exc}",
                          param="messages") from None
    block_size = state.async_llm.engine.config.block_size
    if len(token_ids) < block_size:
        raise bad_request(f"the content renders to {len(token_ids)} tokens; the cache holds whole "
                          f"blocks of {block_size} tokens, so it needs at least {block_size}",
                          param="messages", code="content_too_short")
    registry = state.cached_contents
    if body.name is not None and any(body.name in (c.id, c.name) for c, _ in await registry.live(state.async_llm)):
        raise APIError(409, f"a cached content named {body.name!r} already exists", param="name",
                       code="name_taken")
    gen = await submit(state.async_llm, state.config, state.metrics, new_id("cc-prefill"),
                       [token_ids], SamplingParams(temperature=0.0, max_tokens=1),
                       cache_salt=body.cache_salt, priority=0, param="messages",
                       cache_pins=[CachePin(len(token_ids), ttl_s)])
    (output,) = await gen.final_outputs(request)
    result = output.pins[0] if output.pins else None
    if result is None or result.error is not None or result.pin_id is None:
        reason = result.error if result and result.error else "prefix caching is off"
        raise APIError(409, f"the cached content could not be pinned: {reason}",
                       code="pin_limit" if result and result.error else "not_cacheable")
    content = CachedContent(new_id("cc"), body.name, state.model_name, conversation, token_ids,
                            body.cache_salt, result.pin_id, int(time.time()))
    registry.add(content)
    pin = PinInfo(result.pin_id, [], result.pinned_tokens, result.expires_at)
    return JSONResponse(content.describe(pin, unix_time(state.async_llm.engine.clock)))


async def list_cached_contents(request: Request) -> JSONResponse:
    state = get_state(request)
    to_unix = unix_time(state.async_llm.engine.clock)
    data = [c.describe(p, to_unix) for c, p in await state.cached_contents.live(state.async_llm)]
    return JSONResponse({"object": "list", "data": data})


async def get_cached_content(key: str, request: Request) -> JSONResponse:
    state = get_state(request)
    content, pin = await state.cached_contents.find(state.async_llm, key, param="key")
    return JSONResponse(content.describe(pin, unix_time(state.async_llm.engine.clock)))


async def update_cached_content(key: str, body: CachedContentUpdate, request: Request) -> JSONResponse:
    state = get_state(request)
    ttl_s = parse_ttl(body.ttl, state.config.cache_ttl_scale)
    content, _ = await state.cached_contents.find(state.async_llm, key, param="key")

    def repin(engine) -> PinInfo:
        # PATCH sets the expiry, shorter as well as longer.
        return engine.kv.pin_prefix(content.token_ids, cache_salt=content.cache_salt,
                                    num_tokens=len(content.token_ids), ttl_s=ttl_s, shorten=True)
    try:
        pin = await state.async_llm.run_in_engine(repin)
    except PinLimitError as exc:
        raise APIError(409, f"the cached content could not be pinned again: {exc}",
                       code="pin_limit") from None
    if pin.pin_id is None:
        raise APIError(404, f"cached content {key!r} is no longer in the cache", type="not_found_error",
                       param="key", code="cached_content_not_found")
    content.pin_id = pin.pin_id
    return JSONResponse(content.describe(pin, unix_time(state.async_llm.engine.clock)))


async def delete_cached_content(key: str, request: Request) -> JSONResponse:
    state = get_state(request)
    content, _ = await state.cached_contents.find(state.async_llm, key, param="key")
    if state.cached_contents.remove(content):
        await state.async_llm.run_in_engine(lambda e: e.kv.unpin(content.pin_id))
    return JSONResponse({"id": content.id, "object": "cached_content.deleted", "deleted": True})
