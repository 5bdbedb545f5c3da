"""Which fields a request body may carry, at every depth.

A misspelt field used to be dropped without a word (`"temprature": 0.2` answered 200 at the
default temperature): pydantic ignores extras, and the message, content-part and block models
keep extras on purpose, since chat templates read fields such as `tool_calls`. So the raw JSON
is walked against the body model before it validates: a key the model does not know is a 400
naming its path (`messages[0].contnet`), as OpenAI's API answers, unless the operator lets
clients send extras (serve --allow-unknown-fields), and then the server logs each once.

Fields of the OpenAI and Anthropic APIs that prefixserve does not implement are decided one by
one: those whose absence changes nothing a client relies on are declared on the body models
and ignored (docs/api-fields.md lists them); those whose absence would change the answer are
listed in the model's `unsupported` table and refused with a 400 even when extras are allowed.
"""
from __future__ import annotations

import functools

import logging
import re
import threading
import types
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union, get_args, get_origin

from pydantic import BaseModel

from prefixserve.errors import InvalidRequestError

logger = logging.getLogger(__name__)

# The keys a free-form JSON object may carry; a key's value is the shape of its own object (or of
# each object in its list), or None for any value.
Shape = dict[str, Any]


@dataclass(frozen=True)
class Unsupported:
    """A field prefixserve does not implement and cannot ignore: refused unless `harmless` says
    the value asks for nothing (modalities ["text"])."""
    reason: str
    harmless: Callable[[Any], bool] = lambda value: value is None


def check_fields(data: Any, model: type[BaseModel], allow_unknown: bool) -> list[str]:
    """Refuses an unsupported field, then an unknown one unless `allow_unknown`; returns the
    paths of the unknown fields that were let through. Pure: runs in the render process too."""
    if not isinstance(data, dict):
        return []  # the model's validation says what is wrong
    for name, rule in getattr(model, "unsupported", {}).items():
        if name in data and not rule.harmless(data[name]):
            raise InvalidRequestError(f"{name} is not supported by this server: {rule.reason}",
                                      param=name, code="unsupported_parameter")
    unknown: list[str] = []
    _check_model(data, model, "", unknown)
    if unknown and not allow_unknown:
        noun = "argument" if len(unknown) == 1 else "arguments"
        raise InvalidRequestError(f"Unrecognized request {noun} supplied: {', '.join(unknown[:8])}",
                                  param=unknown[0], code="unknown_parameter")
    return unknown


_logged: set[str] = set()
_logged_lock = threading.Lock()


def log_unknown_fields(paths: list[str]) -> None:
    """Logs each unknown field once per server process, by its path without list indices."""
    for path in paths:
        name = re.sub(r"\[\d+\]", "[]", path)
        with _logged_lock:
            if name in _logged:
                continue
            _logged.add(name)
        logger.warning("request field %r is not one this server knows; accepted and ignored "
                       "(--allow-unknown-fields); logged once", name)


def _check_model(data: dict[str, Any], model: type[BaseModel], path: str, unknown: list[str]) -> None:
    fields = model.model_fields
    # an unsupported field got here with a harmless value (check_fields): known, and dropped
    known = set(fields) | set(getattr(model, "known_extra", ())) | set(getattr(model, "unsupported", ()))
    shapes = _field_shapes(model)
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in known:
            unknown.append(where)
        elif key in shapes:
            _check_shape(value, shapes[key], where, unknown)
        elif key in fields:
            inner = _model_in(fields[key].annotation)
            if inner is not None:
                _each_object(value, where, lambda obj, at: _check_model(obj, inner, at, unknown))


@functools.cache   # per class, not per request: classes do not change
def _field_shapes(model: type[BaseModel]) -> dict[str, Shape]:
    """The model's `field_keys` and its bases': a base's fields keep their shapes in every body
    built on it (prompt_cache_fields.PromptCacheRequest). Read only."""
    shapes: dict[str, Shape] = {}
    for cls in reversed(model.__mro__):
        shapes.update(vars(cls).get("field_keys", {}))
    return shapes


def _check_shape(value: Any, shape: Optional[Shape], path: str, unknown: list[str]) -> None:
    if shape is None:
        return

    def check(obj: dict[str, Any], at: str) -> None:
        for key, item in obj.items():
            where = f"{at}.{key}"
            if key not in shape:
                unknown.append(where)
            else:
                _check_shape(item, shape[key], where, unknown)
    _each_object(value, path, check)


def _each_object(value: Any, path: str, check: Callable[[dict[str, Any], str], None]) -> None:
    if isinstance(value, dict):
        check(value, path)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, dict):
                check(item, f"{path}[{i}]")


def _model_in(annotation: Any) -> Optional[type[BaseModel]]:
    """The body model a field's type holds (Optional[X], list[X], Union[str, list[X]]), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (Union, types.UnionType, list):
        for arg in get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None
