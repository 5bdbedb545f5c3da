"""Rendering chat templates (Jinja) exactly as transformers' apply_chat_template does.

Templates come from model folders downloaded from the Hub, so they are untrusted code: they run in
jinja2's ImmutableSandboxedEnvironment, with the globals and filters transformers provides and
nothing more. The environment settings (trim_blocks, lstrip_blocks, loop controls) and the helpers
(raise_exception, strftime_now, a tojson that keeps non-ASCII text and does not escape HTML,
namespace) follow transformers so that the same template renders the same text.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from prefixserve.errors import ChatTemplateError
from prefixserve.tokenizer.hf_files import ChatTemplateSource

# Message fields that carry reasoning; templates read the first, gpt-oss templates read "thinking".
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateNamespace(jinja2.utils.Namespace):
    """namespace() that refuses underscore names, so templates cannot reach Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - same signature trick as Jinja's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


class _TemplateDict:
    """dict(...) for templates without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _GenerationTag(jinja2.ext.Extension):
    """Accepts {% generation %}...{% endgeneration %} (used by templates to mark assistant text)
    and renders its body."""
    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """Compiles a template once; templates are immutable strings, so caching by source is safe."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template has a syntax error at line {exc.lineno}: {exc.message}") from exc


def select_template(templates: ChatTemplateSource, *, name: str | None, has_tools: bool) -> str:
    """The template source to use: `name` picks a named one (or is itself a template); with tools,
    a template named "tool_use" is preferred over "default", as transformers does."""
    if isinstance(templates, dict):
        if name is not None:
            return templates.get(name, name)
        if has_tools and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        raise ChatTemplateError(f"the model has several chat templates and none is named 'default': "
                                f"pass chat_template= one of {sorted(templates)}")
    if name is not None:
        return name
    if templates is None:
        raise ChatTemplateError("this tokenizer has no chat template (none in tokenizer_config.json, "
                                "chat_template.jinja or chat_template.json): pass chat_template= explicitly")
    return templates


def _normalize_message(message: Any) -> dict:
    if not isinstance(message, Mapping):
        raise ChatTemplateError(f"chat messages must be dicts, got {message!r}")
    # Like transformers: keys set to None (OpenAI clients send content=None, tool_calls=None)
    # are dropped so templates see them as undefined instead of rendering "None".
    normalized = {key: value for key, value in message.items() if value is not None}
    reasoning = next((normalized[k] for k in _REASONING_FIELDS if k in normalized), None)
    if reasoning is not None:
        normalized = {"thinking": reasoning, **normalized, "reasoning_content": reasoning}
    return normalized


def render_chat(source: str, messages: list[Any], *, tools: list[dict] | None, add_generation_prompt: bool,
                special_tokens: Mapping[str, Any], documents: list[dict] | None = None, **kwargs: Any) -> str:
    """Renders one conversation. `special_tokens` (bos_token, eos_token, ...) are visible to the
    template like kwargs, and kwargs override them as in transformers."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatTemplateError("the conversation is empty: pass a non-empty list of messages")
    if tools is not None:
        if not isinstance(tools, (list, tuple)) or not all(isinstance(t, Mapping) for t in tools):
            raise ChatTemplateError("tools must be a list of JSON-schema dicts")
        tools = [dict(t) for t in tools]
    template = compile_template(source)
    variables = {**special_tokens, **kwargs}
    try:
        return template.render(messages=[_normalize_message(m) for m in messages], tools=tools,
                               documents=documents, add_generation_prompt=add_generation_prompt, **variables)
    except (jinja2.exceptions.TemplateError, ArithmeticError, TypeError, ValueError, LookupError,
            AttributeError, RecursionError) as exc:
        # whatever a template raises while rendering (a sandbox limit, bad arithmetic on a
        # message field) is about this template and these messages, not the server
        raise ChatTemplateError(f"chat template error: {exc}") from exc
