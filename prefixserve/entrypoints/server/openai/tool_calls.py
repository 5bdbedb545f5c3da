"""The OpenAI side of tools on POST /v1/chat/completions: the body's tool fields, the history's
tool calls checked, and each finished output turned into `message.tool_calls` (`reply`) or,
streaming, text deltas turned into OpenAI's tool-call deltas (`ToolDeltas`). What both APIs
share (tool_choice, grammars, response_format) is tools.py."""
from __future__ import annotations

import json
from typing import Any, Optional

from prefixserve.entrypoints.server.tools import ChatTools
from prefixserve.errors import InvalidRequestError
from prefixserve.tools import ToolCall, ToolCallStream, parse_tool_calls


def chat_tools(body, tokenizer) -> ChatTools:
    """A chat-completions body's tools, tool_choice, parallel_tool_calls, response_format."""
    return ChatTools.build(body.tools, body.tool_choice, body.parallel_tool_calls,
                           body.response_format, tokenizer)


def reply(tools: ChatTools, text: str) -> tuple[Optional[str], list[dict[str, Any]]]:
    """(content, tool_calls in OpenAI's shape) of a finished output."""
    if not tools.choice.parses_calls:
        return text, []
    content, calls = parse_tool_calls(text, tools.fmt)
    return content, [openai_call(c) for c in calls]


def finish_reason_of(reason: Optional[str], called: bool) -> Optional[str]:
    """OpenAI says "tool_calls" when the model stopped after calling tools."""
    return "tool_calls" if called and reason == "stop" else reason


def openai_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def check_tool_calls(role: str, calls: Any, where: str) -> None:
    """An assistant message's tool_calls must be well-formed function calls (the template writes
    their name and arguments into the prompt); their arguments stay the exact text the client
    sent, so they re-render into the tokens the model wrote."""
    if calls is None:
        return
    if role != "assistant" or not isinstance(calls, list):
        raise InvalidRequestError(f"{where} must be a list, on an assistant message", param=where)
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        ok = isinstance(function, dict) and isinstance(function.get("name"), str) and \
            isinstance(function.get("arguments"), (str, dict)) and call.get("type", "function") == "function"
        if not ok:
            raise InvalidRequestError(
                f"{where}[{j}] must be {{\"id\": ..., \"type\": \"function\", \"function\": "
                f"{{\"name\": ..., \"arguments\": \"<JSON text>\"}}}}", param=f"{where}[{j}]")
        if isinstance(function["arguments"], str):
            try:
                json.loads(function["arguments"])
            except ValueError:
                raise InvalidRequestError(f"{where}[{j}].function.arguments is not JSON text",
                                          param=f"{where}[{j}].function.arguments") from None


class ToolDeltas:
    """One choice's stream: text so far -> the DeltaMessage fields to send (content and/or
    tool_calls deltas: index, then id, type and name once, then argument fragments)."""

    def __init__(self, tools: ChatTools) -> None:
        self.parse = tools.choice.parses_calls
        self.stream = ToolCallStream(tools.fmt)
        self.sent = 0

    @property
    def called(self) -> bool:
        return bool(self.stream.calls)

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        if not self.parse:
            fragment, self.sent = text[self.sent:], len(text)
            return {"content": fragment} if fragment else {}
        events = self.stream.finish(text) if final else self.stream.feed(text)
        content = "".join(e.text for e in events if e.kind == "content")
        calls = []
        for e in events:
            if e.kind == "start":
                calls.append({"index": e.index, "id": e.id, "type": "function",
                              "function": {"name": e.name, "arguments": ""}})
            elif e.kind == "args":
                if calls and calls[-1]["index"] == e.index:
                    calls[-1]["function"]["arguments"] += e.text
                else:
                    calls.append({"index": e.index, "function": {"arguments": e.text}})
        out: dict[str, Any] = {}
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = calls
        return out
