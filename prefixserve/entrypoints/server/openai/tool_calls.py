"""The tool and structured-output parts of POST /v1/chat/completions.

`ChatTools.of(body)` checks tools, tool_choice, parallel_tool_calls, response_format and the
tool calls in the history, and says which grammar (if any) constrains decoding; the route then
turns each finished output into `message.tool_calls` (`reply`) or, streaming, turns text deltas
into OpenAI's tool-call deltas (`ToolDeltas`). `response_format_of` also reads /v1/completions'
response_format: one parser, the same 400s."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Optional

from prefixserve.errors import InvalidRequestError
from prefixserve.structured.spec import StructuredOutput
from prefixserve.tools import ToolCall, ToolCallStream, ToolFormat, ToolSpec, format_of_template, parse_tool_calls
from prefixserve.tools.choice import ToolChoice, call_grammar, tool_choice_of, tool_specs_of


def single_token_id(tokenizer) -> Any:
    """text -> the id of the one token spelling it, if any (the call tags in Qwen vocabularies)."""
    def lookup(text: str) -> Optional[int]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None
    return lookup


def tool_format(tokenizer) -> ToolFormat:
    template = tokenizer.chat_template
    if isinstance(template, dict):  # named templates: any of them teaches the format
        template = "\n".join(template.values())
    return format_of_template(template)


@dataclass(frozen=True)
class ChatTools:
    specs: list[ToolSpec]
    choice: ToolChoice
    fmt: ToolFormat
    structured: Optional[StructuredOutput]

    @classmethod
    def of(cls, body, tokenizer) -> ChatTools:
        """A chat-completions body's tools, tool_choice, parallel_tool_calls, response_format."""
        return cls.build(body.tools, body.tool_choice, body.parallel_tool_calls,
                         body.response_format, tokenizer)

    @classmethod
    def build(cls, tools: Optional[list[dict[str, Any]]], tool_choice: Any,
              parallel: Optional[bool], response_format: Optional[dict[str, Any]],
              tokenizer) -> ChatTools:
        """tools in the template's (OpenAI) shape; tool_choice in either API's shape."""
        specs = tool_specs_of(tools)
        choice = tool_choice_of(tool_choice, specs, parallel=parallel)
        fmt = tool_format(tokenizer)
        structured = call_grammar(choice, specs, fmt, single_token_id(tokenizer))
        response = response_format_of(response_format)
        if response is not None and structured is not None:
            raise InvalidRequestError("response_format cannot be combined with a tool_choice that "
                                      "forces a tool call", param="response_format")
        if response is not None:
            # the output is the format asked for, never a call (a Llama 3 call is JSON too: an
            # answer shaped like one must stay the answer)
            choice = replace(choice, mode="none")
        return cls(specs, choice, fmt, structured or response)

    def reply(self, text: str) -> tuple[Optional[str], list[dict[str, Any]]]:
        """(content, tool_calls in OpenAI's shape) of a finished output."""
        if not self.choice.parses_calls:
            return text, []
        content, calls = parse_tool_calls(text, self.fmt)
        return content, [openai_call(c) for c in calls]


def finish_reason_of(reason: Optional[str], called: bool) -> Optional[str]:
    """OpenAI says "tool_calls" when the model stopped after calling tools."""
    return "tool_calls" if called and reason == "stop" else reason


def openai_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def response_format_of(raw: Optional[dict[str, Any]]) -> Optional[StructuredOutput]:
    if raw is None:
        return None
    kind = raw.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        spec = raw.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequestError("response_format.json_schema.schema must be a JSON schema object",
                                      param="response_format.json_schema.schema")
        return StructuredOutput.json_schema(schema)
    raise InvalidRequestError(f"response_format.type must be \"text\", \"json_object\" or "
                              f"\"json_schema\", got {str(kind)[:40]!r}", param="response_format.type")


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
