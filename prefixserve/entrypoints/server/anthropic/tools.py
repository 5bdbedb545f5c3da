"""The tool parts of POST /v1/messages: tools (Anthropic's shape) and tool_choice checked, the
grammar a forced choice puts on decoding, and the reply's content blocks (the calls parsed from
the output become `tool_use` blocks after any text) and stop reason."""
from __future__ import annotations

from typing import Any, Optional

from prefixserve.entrypoints.server.prompting.conversations import tool_of
from prefixserve.entrypoints.server.tools import ChatTools
from prefixserve.tools import ToolCall, parse_tool_calls


def message_tools(body, tokenizer) -> ChatTools:
    specs = [tool_of(t, f"tools[{i}]").spec for i, t in enumerate(body.tools or [])]
    return ChatTools.build(specs, body.tool_choice, None, None, tokenizer)


def reply(tools: ChatTools, text: str) -> tuple[list[dict[str, Any]], bool]:
    """(content blocks, whether the model called tools) of a finished output."""
    if not tools.choice.parses_calls:
        return [{"type": "text", "text": text}], False
    content, calls = parse_tool_calls(text, tools.fmt)
    for call in calls:
        call.id = "toolu_" + call.id.removeprefix("call_")
    blocks = reply_blocks(content, calls, text_first=tools.fmt != "llama3")
    return blocks or [{"type": "text", "text": ""}], bool(calls)


def stop_reason_of(stop_reason: Optional[str], called: bool) -> Optional[str]:
    return "tool_use" if called and stop_reason == "end_turn" else stop_reason


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": call.input()}


def reply_blocks(content: Optional[str], calls: list[ToolCall], *, text_first: bool = True
                 ) -> list[dict[str, Any]]:
    """text_first=False for a format whose text can only follow the calls (Llama 3), so the
    blocks come in the order a stream of the same output sends them."""
    text: list[dict[str, Any]] = [{"type": "text", "text": content}] if content else []
    uses = [tool_use_block(c) for c in calls]
    return text + uses if text_first else uses + text
