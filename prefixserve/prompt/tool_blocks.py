"""Anthropic-shaped tool blocks -> the turns the chat template reads. The Messages endpoint,
named cached contents and the log lint (diagnose/log_reader.py) all take them; the blocks of a
reply are the server's anthropic/tools.py's.

An assistant message's `tool_use` blocks become its `tool_calls` (arguments written as
json.dumps writes them, the way structured decoding generates them, so a call the model made
re-renders into the same text) and a user message's `tool_result` blocks become `tool` turns, in
order, with the text around them as user turns."""
from __future__ import annotations

import json
from typing import Any

from prefixserve.errors import InvalidRequestError
from prefixserve.prompt.conversation import Part, Turn, parse_cache_control

TOOL_BLOCKS = ("tool_use", "tool_result")


def _block(raw: Any) -> dict[str, Any]:
    return raw.model_dump(exclude_none=True) if hasattr(raw, "model_dump") else raw


def has_tool_blocks(content: Any) -> bool:
    return isinstance(content, list) and any(
        isinstance(b, dict) and b.get("type") in TOOL_BLOCKS for b in map(_block, content))


def tool_turns(role: str, content: list[Any], where: str) -> list[Turn]:
    """The turns of one message holding tool_use or tool_result blocks."""
    blocks = [_block(b) for b in content]
    if role == "assistant":
        return [_assistant_turn(blocks, where)]
    turns: list[Turn] = []
    text_parts: list[Part] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if block.get("type") == "tool_result":
            if text_parts:
                turns.append(Turn({"role": "user"}, text_parts))
                text_parts = []
            turns.append(_result_turn(block, at))
        elif block.get("type") == "text" and isinstance(block.get("text"), str):
            text_parts.append(Part(block["text"], parse_cache_control(block.get("cache_control"), at), at))
        else:
            raise InvalidRequestError(f"{at}: a user message holds text and tool_result blocks, got "
                                      f"{str(block.get('type'))[:40]!r}", param=at)
    if text_parts:
        turns.append(Turn({"role": "user"}, text_parts))
    return turns


def _assistant_turn(blocks: list[dict[str, Any]], where: str) -> Turn:
    parts: list[Part] = []
    calls = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            if calls:
                raise InvalidRequestError(f"{at}: text after tool_use blocks cannot be rendered in "
                                          f"order; put it before them", param=at)
            parts.append(Part(block["text"], parse_cache_control(block.get("cache_control"), at), at))
        elif kind == "tool_use":
            name, tool_input, call_id = block.get("name"), block.get("input"), block.get("id")
            if not isinstance(name, str) or not isinstance(tool_input, dict) or not isinstance(call_id, str):
                raise InvalidRequestError(f"{at}: a tool_use block needs a string id and name and an "
                                          f"object input", param=at)
            calls.append({"id": call_id, "type": "function", "function": {
                "name": name, "arguments": json.dumps(tool_input, ensure_ascii=False)}})
        else:
            raise InvalidRequestError(f"{at}: an assistant message holds text and tool_use blocks, "
                                      f"got {str(kind)[:40]!r}", param=at)
    return Turn({"role": "assistant", "tool_calls": calls}, parts or None)


def _result_turn(block: dict[str, Any], at: str) -> Turn:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise InvalidRequestError(f"{at}.tool_use_id must be a string", param=f"{at}.tool_use_id")
    content = block.get("content", "")
    if isinstance(content, list):
        texts = []
        for k, inner in enumerate(content):
            inner = _block(inner)
            if not isinstance(inner, dict) or inner.get("type") != "text" or not isinstance(inner.get("text"), str):
                raise InvalidRequestError(f"{at}.content[{k}]: tool results hold text blocks only",
                                          param=f"{at}.content[{k}]")
            texts.append(inner["text"])
        content = "\n".join(texts)
    if not isinstance(content, str):
        raise InvalidRequestError(f"{at}.content must be a string or text blocks", param=f"{at}.content")
    if block.get("is_error") is True:
        content = "Error: " + content
    return Turn({"role": "tool", "tool_call_id": call_id},
                [Part(content, parse_cache_control(block.get("cache_control"), at), at)])
