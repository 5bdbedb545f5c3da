"""Parsing tool calls out of a finished output, in the model family's native format.

- "qwen" (Qwen2.5 / Qwen3, Hermes style; the built-in template's): each call is
  `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, text may come before them.
- "llama3" (Llama 3.1-3.3 JSON tool calling): the whole output is `{"name": ..., "parameters":
  {...}}` (optionally after `<|python_tag|>`), several calls separated by `;`.

Arguments are returned as the exact text the model wrote, not re-serialised: a client that sends
them back in the history gets the very tokens the model produced, so the next turn's prompt
extends this one's (re-serialising could reorder keys or change spacing and miss the cache).
A call that does not parse stays in the content as text: nothing the model wrote is lost.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

ToolFormat = Literal["qwen", "llama3"]

QWEN_OPEN, QWEN_CLOSE = "<tool_call>", "</tool_call>"
LLAMA_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def new_call_id(prefix: str = "call_") -> str:
    return prefix + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolSpec:
    """A function a request offers: its name and its parameters' JSON schema."""
    name: str
    parameters: dict[str, Any]


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object, as the model wrote it
    id: str = field(default_factory=new_call_id)

    def input(self) -> dict[str, Any]:
        return json.loads(self.arguments)


def format_of_template(template: Optional[str]) -> ToolFormat:
    """The tool-call format a chat template teaches its model; the Qwen format by default."""
    if template and QWEN_OPEN not in template and ("<|python_tag|>" in template or "ipython" in template):
        return "llama3"
    return "qwen"


def call_of_json(text: str, args_key: str) -> Optional[ToolCall]:
    """A call from the JSON text of one {"name": ..., args_key: {...}} object, keeping the
    arguments' text as written; None if it is not such an object."""
    text = text.strip()
    try:
        obj, end = _DECODER.raw_decode(text)
    except ValueError:
        return None
    if end != len(text) or not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters")))
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], _raw_value(text, args) or json.dumps(args, ensure_ascii=False))


def _raw_value(text: str, args: dict) -> Optional[str]:
    """The exact text of the object's arguments value: the last top-level value that decodes to
    `args` (keys come before values, so scan the object's members in order)."""
    pos = text.index("{") + 1
    while True:
        try:
            _, pos = _DECODER.raw_decode(text, _skip(text, pos))  # a key
            pos = _skip(text, pos)
            if text[pos] != ":":
                return None
            start = _skip(text, pos + 1)
            value, pos = _DECODER.raw_decode(text, start)
        except (ValueError, IndexError):
            return None
        if isinstance(value, dict) and value == args:
            return text[start:pos]
        pos = _skip(text, pos)
        if pos >= len(text) or text[pos] != ",":
            return None
        pos += 1


def _skip(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\n\r":
        pos += 1
    return pos


def parse_tool_calls(text: str, fmt: ToolFormat) -> tuple[Optional[str], list[ToolCall]]:
    """(content, calls) of a finished output; content is None when only calls were written."""
    if fmt == "llama3":
        return _parse_llama3(text)
    calls: list[ToolCall] = []
    kept: list[str] = []
    pos = search = 0
    while (start := text.find(QWEN_OPEN, search)) >= 0:
        found = qwen_call_at(text, start + len(QWEN_OPEN))
        if found is None:
            search = start + len(QWEN_OPEN)
            continue
        call, end = found
        kept.append(text[pos:start])
        calls.append(call)
        pos = search = end
    kept.append(text[pos:])
    if not calls:
        return text, []
    content = "".join(kept).strip()
    return (content or None), calls


def qwen_call_at(text: str, body_start: int) -> Optional[tuple[ToolCall, int]]:
    """The call whose body starts at body_start and the position after its closing tag: the
    first closing tag that ends a parsable call (arguments may hold the tag inside a string)."""
    close = text.find(QWEN_CLOSE, body_start)
    while close >= 0:
        call = call_of_json(text[body_start:close], "arguments")
        if call is not None:
            return call, close + len(QWEN_CLOSE)
        close = text.find(QWEN_CLOSE, close + 1)
    return None


def _parse_llama3(text: str) -> tuple[Optional[str], list[ToolCall]]:
    body = text.strip()
    if body.startswith(LLAMA_TAG):
        body = body[len(LLAMA_TAG):]
    if not body.lstrip().startswith("{"):
        return text, []
    calls = []
    for piece in _split_top_level(body, ";"):
        call = call_of_json(piece, "parameters")
        if call is None:
            return text, []
        calls.append(call)
    return None, calls


def _split_top_level(text: str, sep: str) -> list[str]:
    """Splits on `sep` outside JSON strings and brackets."""
    pieces, depth, in_string, escaped, start = [], 0, False, False, 0
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == sep and depth == 0:
            pieces.append(text[start:i])
            start = i + 1
    pieces.append(text[start:])
    return [p for p in pieces if p.strip()]
