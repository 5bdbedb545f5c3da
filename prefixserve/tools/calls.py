"""Parsing tool calls out of a finished output, in the model family's native format.

- "qwen" (Qwen2.5 / Qwen3, Hermes style; the built-in template's): each call is
  `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, text may come before them.
- "llama3" (Llama 3.1-3.3 JSON tool calling): the output is calls when it starts (after an
  optional `<|python_tag|>`) with `{"name": "...", "parameters": {` (or "arguments"; Llama 3.2
  may put `"type": "function"` first), several separated by `;`; anything after the last call is
  content. Deciding by that header, as a stream can, keeps content that merely looks like JSON
  (`{"answer": 42}`) content.

Arguments are returned as the exact text the model wrote, not re-serialised: a client that sends
them back in the history gets the very tokens the model produced, so the next turn's prompt
extends this one's (re-serialising could reorder keys or change spacing and miss the cache).
A Qwen call that does not parse stays in the content as text: nothing the model wrote is lost.
A call the output ends inside (max_tokens) is still a call, `complete=False`, holding the
arguments written so far: what a stream has already sent of it.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import jiter
import regex

ToolFormat = Literal["qwen", "llama3"]

QWEN_OPEN, QWEN_CLOSE = "<tool_call>", "</tool_call>"
_DECODER = json.JSONDecoder()

# Where a call's arguments object begins: a call is recognised by this header (the name first,
# as the formats' templates teach), so a stream can send its name and arguments as they come.
QWEN_HEADER = regex.compile(r'\s*\{\s*"name"\s*:\s*"(?P<name>[^"\\]*)"\s*,\s*"arguments"\s*:\s*\{')
_LLAMA_CALL = (r'(?P<open>\{)\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:\s*"(?P<name>[^"\\]*)"'
               r'\s*,\s*"(?:parameters|arguments)"\s*:\s*\{')
# Llama 3: the output is calls when it starts with one (after an optional <|python_tag|>), and
# each further call follows a `;`.
LLAMA_FIRST = regex.compile(r"\s*(?:<\|python_tag\|>)?\s*" + _LLAMA_CALL)
LLAMA_NEXT = regex.compile(r"\s*;\s*" + _LLAMA_CALL)


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
    # False when the output ended inside the call's JSON (max_tokens): the arguments are what
    # was written of them
    complete: bool = True

    def input(self) -> dict[str, Any]:
        if self.complete:
            return json.loads(self.arguments)
        # what a cut call's arguments hold so far, read as Anthropic's SDK reads a streamed
        # partial input (an unfinished string or number is left out)
        try:
            return jiter.from_json(self.arguments.encode(), partial_mode=True)
        except ValueError:
            return {}


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


def call_extent(text: str, open_at: int, args_start: int) -> tuple[str, Optional[int]]:
    """(arguments, end of the call's object) of the call whose object opens at open_at and whose
    arguments object at args_start; the end is None while the object is open. Arguments still
    open are all the text after args_start (whatever follows can only extend them); once closed,
    exactly their object's text."""
    try:
        _, args_end = _DECODER.raw_decode(text, args_start)
    except ValueError:
        return text[args_start:].rstrip(), None
    try:
        _, end = _DECODER.raw_decode(text, open_at)
    except ValueError:
        return text[args_start:args_end], None
    return text[args_start:args_end], end


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
    if (cut := _cut_qwen_call(text, pos)) is not None:
        call, at = cut
        kept[-1] = text[pos:at]
        calls.append(call)
    if not calls:
        return text, []
    content = "".join(kept).strip()
    return (content or None), calls


def _cut_qwen_call(text: str, pos: int) -> Optional[tuple[ToolCall, int]]:
    """The call the output ended inside, and where its tag is: the first `<tool_call>` after
    pos, once its header is written, when its JSON is still open (a valid beginning) or closed
    with no closing tag after it. (Malformed JSON stays content.)"""
    at = text.find(QWEN_OPEN, pos)
    m = QWEN_HEADER.match(text, at + len(QWEN_OPEN)) if at >= 0 else None
    if m is None:
        return None
    open_at = text.index("{", m.start())
    arguments, end = call_extent(text, open_at, m.end() - 1)
    cut = is_json_prefix(text[open_at:]) if end is None else QWEN_CLOSE not in text[end:]
    return (ToolCall(m.group("name"), arguments, complete=end is not None), at) if cut else None


def is_json_prefix(text: str) -> bool:
    """Whether `text` begins some JSON document (json cannot tell cut from malformed; jiter's
    partial mode can)."""
    try:
        jiter.from_json(text.encode(), partial_mode="trailing-strings")
    except ValueError:
        return False
    return True


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
    calls: list[ToolCall] = []
    pos = 0
    while (m := (LLAMA_NEXT if calls else LLAMA_FIRST).match(text, pos)) is not None:
        arguments, end = call_extent(text, m.start("open"), m.end() - 1)
        calls.append(ToolCall(m.group("name"), arguments, complete=end is not None))
        if end is None:
            return None, calls
        pos = end
    if not calls:
        return text, []
    return (text[pos:].strip() or None), calls
