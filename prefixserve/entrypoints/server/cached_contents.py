"""Named cached contents: a system prompt, tools and messages computed once and pinned.

POST /v1/cached_contents renders the content through the chat template (no generation
prompt), prefills it through the engine (max_tokens=1) and pins its whole rendered prefix
(every full block) for its TTL. A chat or Messages request naming it with `cached_content`
is rendered as the content's conversation followed by the request's messages; the server
checks that the rendered prompt's tokens start with the content's tokens (400 otherwise),
so the pinned blocks are a guaranteed hit.

The engine keeps the contents (see prefixserve/engine/cached_contents.py): each operation is
one atomic engine call, and a content is registered in the same call that pins it. A
content whose pin expired (or was dropped by /reset_prefix_cache) is gone. Identical
contents share one pin; it is released when the last of them is deleted.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Annotated, Any, Optional, Union

from fastapi import Depends, Request
from fastapi.responses import JSONResponse
from pydantic import Field

from prefixserve.engine import CachedContent, CachePin, PinInfo
from prefixserve.entrypoints.server.errors import APIError, bad_request
from prefixserve.entrypoints.server.generation import submit
from prefixserve.entrypoints.server.prompting.bodies import json_body
from prefixserve.entrypoints.server.prompting.conversations import conversation_of
from prefixserve.entrypoints.server.prompting.pins import unix_time
from prefixserve.entrypoints.server.protocol import StrictModel
from prefixserve.entrypoints.server.rendering import render_or_400
from prefixserve.entrypoints.server.state import get_state, new_id, principal
from prefixserve.prompt import Conversation
from prefixserve.sampling_params import SamplingParams

_TTL = re.compile(r"^\s*(\d{1,9}(?:\.\d{1,9})?)\s*(s|m|h)\s*$")
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


def describe(content: CachedContent, pin: PinInfo, to_unix) -> dict[str, Any]:
    return {
        "id": content.id, "object": "cached_content", "name": content.name,
        "model": content.payload.model, "created": content.created,
        "expire_time": None if pin.expires_at is None else to_unix(pin.expires_at),
        "usage": {"total_tokens": len(content.token_ids), "cached_tokens": pin.num_tokens},
    }


@dataclass(frozen=True)
class ContentPayload:
    """What the server keeps with a content to use it again."""
    model: str
    conversation: Conversation


def parse_ttl(value: Union[str, int, float], scale: float, max_s: float) -> float:
    """Seconds of a TTL given as seconds or "300s" / "5m" / "1h" (at most max_s), times the
    server's scale."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise bad_request(f"ttl must be seconds or a string like \"5m\", got {value!r}", param="ttl")
    if isinstance(value, str):
        match = _TTL.match(value)
        if match is None:
            raise bad_request(f"ttl must be seconds or a string like \"300s\", \"5m\" or \"1h\", "
                              f"got {value[:40]!r}", param="ttl")
        seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    elif isinstance(value, int) and abs(value) > max_s:  # before float(): 10**400 overflows it
        seconds = float("inf")
    else:
        seconds = float(value)
    if not 0 < seconds <= max_s:  # also refuses NaN and infinity
        raise bad_request(f"ttl must be more than 0 and at most {max_s:g} seconds", param="ttl")
    return seconds * scale


async def create_cached_content(body: Annotated[CachedContentCreate, Depends(json_body(CachedContentCreate))],
                                request: Request) -> JSONResponse:
    state = get_state(request)
    state.check_model(body.model)
    namespace = state.namespace(request, body.cache_salt)
    ttl_s = parse_ttl(body.ttl, state.config.cache_ttl_scale, state.config.max_cache_ttl_s)
    conversation = conversation_of(body.system, body.messages, body.tools).unmarked()
    if not conversation.turns:
        raise bad_request("a cached content needs a system prompt or at least one message",
                          param="messages")
    token_ids = (await render_or_400(state, conversation, add_generation_prompt=False,
                                     template_kwargs=body.chat_template_kwargs)).token_ids
    block_size = state.async_llm.info.block_size
    if len(token_ids) < block_size:
        raise bad_request(f"the content renders to {len(token_ids)} tokens; the cache holds whole "
                          f"blocks of {block_size} tokens, so it needs at least {block_size}",
                          param="messages", code="content_too_short")
    if body.name is not None and await state.async_llm.cached_content_name_taken(body.name, namespace):
        raise APIError(409, f"a cached content named {body.name!r} already exists", param="name",
                       code="name_taken")
    tenant = principal(request).tenant
    content = CachedContent(new_id("cc"), body.name, token_ids, namespace, int(time.time()),
                            payload=ContentPayload(state.model_name, conversation), owner=namespace,
                            tenant=tenant)
    gen = await submit(state.async_llm, state.config, state.metrics, new_id("cc-prefill"),
                       [token_ids], SamplingParams(temperature=0.0, max_tokens=1),
                       cache_salt=namespace, priority=0, param="messages",
                       cache_pins=[CachePin(len(token_ids), ttl_s, content=content, tenant=tenant)],
                       tenant=tenant)
    (output,) = await gen.final_outputs(request)
    result = output.pins[0] if output.pins else None
    if result is not None and result.error is not None:
        raise APIError(409, f"the cached content was not created: {result.error}",
                       param="name" if result.error_code == "name_taken" else None, code=result.error_code)
    if result is None or result.pin_id is None:
        raise APIError(409, "the cached content could not be pinned: prefix caching is off",
                       code="not_cacheable")
    pin = PinInfo(result.pin_id, result.pinned_tokens, result.expires_at)
    return JSONResponse(describe(content, pin, unix_time(state.async_llm.now)))


# The routes below act within the caller's namespace: its tenant, and the cache_salt query
# parameter where the contents were created with a salt. Another namespace's contents are
# not found, exactly as if they did not exist.

async def list_cached_contents(request: Request, cache_salt: Optional[str] = None) -> JSONResponse:
    state = get_state(request)
    to_unix = unix_time(state.async_llm.now)
    owned = await state.async_llm.cached_contents(state.namespace(request, cache_salt))
    return JSONResponse({"object": "list", "data": [describe(c, p, to_unix) for c, p in owned]})


async def get_cached_content(key: str, request: Request, cache_salt: Optional[str] = None) -> JSONResponse:
    state = get_state(request)
    content, pin = await state.async_llm.find_cached_content(
        key, state.namespace(request, cache_salt), param="key")
    return JSONResponse(describe(content, pin, unix_time(state.async_llm.now)))


async def update_cached_content(key: str, body: Annotated[CachedContentUpdate, Depends(json_body(CachedContentUpdate))],
                                request: Request,
                                cache_salt: Optional[str] = None) -> JSONResponse:
    state = get_state(request)
    ttl_s = parse_ttl(body.ttl, state.config.cache_ttl_scale, state.config.max_cache_ttl_s)
    # PATCH sets the expiry, shorter as well as longer.
    content, pin = await state.async_llm.repin_cached_content(
        key, ttl_s, state.namespace(request, cache_salt), param="key")
    return JSONResponse(describe(content, pin, unix_time(state.async_llm.now)))


async def delete_cached_content(key: str, request: Request, cache_salt: Optional[str] = None) -> JSONResponse:
    state = get_state(request)
    content = await state.async_llm.delete_cached_content(key, state.namespace(request, cache_salt), param="key")
    return JSONResponse({"id": content.id, "object": "cached_content.deleted", "deleted": True})
