"""Request bodies: parsed, checked and validated, in the render process when they are large.

Parsing JSON and validating it with pydantic holds the GIL, and the engine thread needs the GIL
between every kernel of a step: in the server process, a chat of 20,000 messages stalled every
running stream for about half a second, most of it spent turning the messages into a
Conversation and pickling that for the render process. So a body above `offload_body_bytes`
goes to the render process as raw bytes; it is parsed, checked (validation.py), validated and,
for the chat endpoints, turned into the conversation there, and only the small fields come
back. The conversation stays in the render process until the request renders it (a
ParsedConversation names it). Small bodies take the same functions in the server process,
where they cost less than a trip to the child.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Union

from fastapi import Request
from pydantic import BaseModel, ValidationError
from fastapi.exceptions import RequestValidationError

from prefixserve.entrypoints.server.errors import validation_error
from prefixserve.entrypoints.server.fields import check_fields, log_unknown_fields
from prefixserve.entrypoints.server.validation import BodyLimits, check_parsed_body
from prefixserve.errors import InvalidRequestError
from prefixserve.prompt import Conversation


@dataclass(frozen=True)
class ChatKind:
    """A chat endpoint's body: its model, how its conversation is built, and the fields that
    hold the conversation (left out of what comes back from the render process)."""
    name: str
    model: type[BaseModel]
    conversation: Callable[[Any], Conversation]
    conversation_fields: dict[str, Any]


# The chat endpoints' bodies by the name a dependency and the render process know them by. Each
# dialect registers its own (openai/conversation.py, anthropic/conversation.py), so this module
# never imports a dialect; the render process gets the table when it starts (render_pool.py).
CHAT_KINDS: dict[str, ChatKind] = {}


def register_chat_kind(kind: ChatKind) -> ChatKind:
    CHAT_KINDS[kind.name] = kind
    return kind


@dataclass(frozen=True)
class ParsedConversation:
    """A conversation the render process built from a body and keeps until it is rendered. The
    raw body rides along: a child started since (the last one was killed) parses it again."""
    key: str
    kind: str
    raw: bytes
    limits: BodyLimits


ConversationSource = Union[Conversation, ParsedConversation]


@dataclass(frozen=True)
class ParsedChat:
    """A chat endpoint's validated body and its conversation. For a large body, `body` comes
    from the render process without the conversation's fields (messages, system): read the
    conversation from `source` only."""
    body: Any
    source: ConversationSource


def parse_body(raw: bytes, model: type[BaseModel], limits: BodyLimits) -> BaseModel:
    """JSON bytes -> a validated model; every failure is an InvalidRequestError naming the
    field, the same wherever this runs."""
    if not raw.strip():
        raise InvalidRequestError("the request needs a JSON body", code="invalid_json")
    try:
        data = json.loads(raw)
    except RecursionError:
        raise InvalidRequestError("the body nests too deeply to parse", code="invalid_json") from None
    except ValueError as exc:  # JSONDecodeError, and bytes that are not UTF-8
        raise InvalidRequestError(f"malformed JSON body: {exc}", code="invalid_json") from None
    check_parsed_body(data, limits)
    unknown = check_fields(data, model, limits.allow_unknown_fields)
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False, include_context=False)]
        raise validation_error(RequestValidationError(errors)) from None
    if unknown:
        body._unknown_fields = tuple(unknown)  # logged by the server process (_logged)
    return body


def _logged(body: Any) -> Any:
    log_unknown_fields(list(getattr(body, "_unknown_fields", ())))
    return body


def parse_chat(raw: bytes, kind: str, limits: BodyLimits) -> tuple[BaseModel, Conversation]:
    chat = CHAT_KINDS[kind]
    body = parse_body(raw, chat.model, limits)
    return body, chat.conversation(body)


def _limits(request: Request) -> BodyLimits:
    config = request.app.state.server.config
    return BodyLimits(config.max_messages, config.trust_request_chat_template, config.allow_unknown_fields)


async def _raw(request: Request) -> bytes:
    kind = request.headers.get("content-type")
    if kind is not None and "json" not in kind:
        raise InvalidRequestError(f"the request body must be JSON (Content-Type: application/json), "
                                  f"got {kind[:60]!r}", code="invalid_json")
    return await request.body()


def _offloaded(request: Request, raw: bytes) -> bool:
    return len(raw) > request.app.state.server.config.offload_body_bytes


def json_body(model: type[BaseModel]) -> Callable:
    """A FastAPI dependency giving `model` validated from the request's body."""
    async def dependency(request: Request) -> Any:
        raw = await _raw(request)
        if _offloaded(request, raw):
            return _logged(await request.app.state.server.renderer.parse(raw, model, _limits(request)))
        return _logged(parse_body(raw, model, _limits(request)))
    return dependency


def chat_body(kind: str) -> Callable:
    """A FastAPI dependency giving a chat endpoint's ParsedChat."""
    async def dependency(request: Request) -> ParsedChat:
        raw = await _raw(request)
        if _offloaded(request, raw):
            body, source = await request.app.state.server.renderer.parse_chat(raw, kind, _limits(request))
            return ParsedChat(_logged(body), source)
        body, conversation = parse_chat(raw, kind, _limits(request))
        return ParsedChat(_logged(body), conversation)
    return dependency


def request_body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The operation's requestBody for OpenAPI, since the body is not a FastAPI parameter."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def add_body_schemas(schema: dict[str, Any], models: list[type[BaseModel]]) -> dict[str, Any]:
    """Puts the body models (and the models they use) into an OpenAPI document's components."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in models:
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
    return schema
