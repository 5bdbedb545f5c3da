"""The objects /v1/responses answers with, in OpenAI's wire format: the response, its output
items (an assistant message, function calls) and usage."""
from __future__ import annotations

import time
from typing import Any, Optional

from prefixserve.entrypoints.server.response_store import RESPONSE_ID
from prefixserve.entrypoints.server.responses.items import item_id
from prefixserve.entrypoints.server.responses.protocol import ResponsesRequest
from prefixserve.entrypoints.server.tools import ChatTools
from prefixserve.entrypoints.server.usage import TokenUsage
from prefixserve.tools import parse_tool_calls


def response_id(request_id: str) -> str:
    """The response id of a generation request id ("resp-<hex>" -> "resp_<hex>", OpenAI's spelling)."""
    return "resp_" + request_id.split("-", 1)[1]


def request_id_of(rid: Optional[str]) -> Optional[str]:
    """The generation request id of a response id (for diagnose_against); any other id as it is."""
    return "resp-" + rid[len("resp_"):] if rid is not None and RESPONSE_ID.fullmatch(rid) else rid


def message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text)]}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(tools: ChatTools, text: str, finish_reason: Optional[str]) -> list[dict[str, Any]]:
    """A finished output as items: the message (when it wrote text, or wrote nothing at all), then
    each function call."""
    content, calls = parse_tool_calls(text, tools.fmt) if tools.choice.parses_calls else (text, [])
    status = "incomplete" if finish_reason == "length" else "completed"
    items = [message_item(content or "", status)] if content or not calls else []
    return items + [call_item(c.id, c.name, c.arguments, "completed" if c.complete else "incomplete")
                    for c in calls]


def usage_object(usage: TokenUsage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.read, "cache_write_tokens": usage.written},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def response_object(rid: str, body: ResponsesRequest, model: str, created: float, *, status: str,
                    output: list[dict[str, Any]], usage: Optional[TokenUsage] = None) -> dict[str, Any]:
    """The response as OpenAI writes it; status "in_progress" (a stream's opening), "completed" or
    "incomplete" (stopped by max_output_tokens)."""
    fmt = body.text.format if body.text is not None and body.text.format is not None else {"type": "text"}
    return {
        "id": rid, "object": "response", "created_at": created, "status": status,
        "completed_at": time.time() if status != "in_progress" else None, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": model,
        "output": output,
        "parallel_tool_calls": True if body.parallel_tool_calls is None else body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id, "store": body.store,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "tools": body.tools or [], "text": {"format": fmt}, "truncation": body.truncation or "disabled",
        "metadata": body.metadata or {}, "user": body.user, "service_tier": "default",
        "prompt_cache_key": body.prompt_cache_key, "prompt_cache_retention": body.prompt_cache_retention,
        "usage": usage_object(usage) if usage is not None else None,
    }
