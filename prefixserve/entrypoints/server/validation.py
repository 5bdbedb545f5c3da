"""Checks every JSON body gets before a model validates it, whatever the endpoint.

Pydantic checks each field's type; what it lets through, and what used to fail deep in the
engine step (ending every request in it) or in the tokenizer (a 500), is refused here with a
400 naming the field: strings that are not valid Unicode (a lone UTF-16 surrogate), numbers
that are not finite (Python's JSON parser accepts NaN and Infinity), integers no engine type
holds (a top_k of 10**29), nesting too deep to walk, and more messages than the server takes.
Chat-template variables are plain values, and never a template of the client's own unless
the operator trusts clients with it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from prefixserve.errors import InvalidRequestError

MAX_DEPTH = 32
# names and ids a client sends are short; a long one is a mistake or an attack
MAX_NAME_CHARS = 256
NAME_FIELDS = ("model", "name", "cache_salt", "cached_content", "diagnose_against", "user")
# int64 (the widest engine type); narrower fields are bounded where they are used
MAX_INT = 2**63 - 1
# what a template may read besides messages and tools; a client template rides in chat_template
RESERVED_TEMPLATE_KWARGS = {"chat_template", "messages", "tools", "documents", "add_generation_prompt",
                            "tokenize", "tokenizer", "continue_final_message"}


@dataclass(frozen=True)
class BodyLimits:
    """What a server takes; crosses into the process that parses large bodies."""
    max_messages: int
    trust_request_chat_template: bool
    allow_unknown_fields: bool = False


def check_parsed_body(body: Any, limits: BodyLimits) -> None:
    """The checks of a parsed JSON body, before any model validates it. Pure, so that it runs in
    the server and in the render process alike."""
    # counted before anything walks them: a refused body should cost as little as possible
    messages = body.get("messages") if isinstance(body, dict) else None
    if isinstance(messages, list) and len(messages) > limits.max_messages:
        raise InvalidRequestError(f"{len(messages)} messages; this server takes at most "
                                  f"{limits.max_messages} per request", param="messages",
                                  code="too_many_messages")
    _walk(body, "", 0)
    if isinstance(body, dict):
        for name in NAME_FIELDS:
            if isinstance(body.get(name), str) and len(body[name]) > MAX_NAME_CHARS:
                raise InvalidRequestError(f"{name} is longer than {MAX_NAME_CHARS} characters", param=name)
        check_template_fields(body, limits.trust_request_chat_template)


def check_template_fields(body: dict[str, Any], trusted: bool) -> None:
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, dict):
        for key in kwargs:
            if key in RESERVED_TEMPLATE_KWARGS or not key.isidentifier():
                raise InvalidRequestError(f"chat_template_kwargs may not set {key!r}",
                                          param=f"chat_template_kwargs.{key}")
    if body.get("chat_template") is not None and not trusted:
        raise InvalidRequestError("this server does not run chat templates sent by clients (start it with "
                                  "--trust-request-chat-template to allow them)", param="chat_template",
                                  code="chat_template_not_allowed")


def _walk(value: Any, path: str, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise InvalidRequestError(f"the body nests deeper than {MAX_DEPTH} levels", param=path or None)
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidRequestError(f"{path or 'body'} is not valid Unicode (a lone UTF-16 surrogate)",
                                          param=path or None, code="invalid_unicode") from None
    elif isinstance(value, bool) or value is None:
        return
    elif isinstance(value, int):
        if not -MAX_INT - 1 <= value <= MAX_INT:
            raise InvalidRequestError(f"{path or 'body'} is an integer beyond 64 bits", param=path or None)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidRequestError(f"{path or 'body'} must be a finite number", param=path or None)
    elif isinstance(value, dict):
        for key, item in value.items():
            _walk(key, path, depth + 1)
            _walk(item, _join(path, key), depth + 1)
    elif isinstance(value, list):
        if depth < MAX_DEPTH and set(map(type, value)) == {int}:
            # token ids, the one long list a body carries: checked in bulk (a path string and a
            # call per id cost ~0.3 ms a 900-token prompt on the event loop); an offender is
            # found and named by the walk below
            if -MAX_INT - 1 <= min(value) and max(value) <= MAX_INT:
                return
        for i, item in enumerate(value):
            _walk(item, f"{path}[{i}]", depth + 1)


def _join(path: str, key: str) -> Optional[str]:
    return f"{path}.{key}" if path else key
