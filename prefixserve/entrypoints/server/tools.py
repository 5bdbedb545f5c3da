"""The tools and structured output a generation request asks for, in either API's shape.

`ChatTools.build` checks tools, tool_choice, parallel_tool_calls, response_format and says which
grammar (if any) constrains decoding; both dialects build theirs here (openai/tool_calls.py,
anthropic/tools.py) and turn the finished output or the streamed text into their own reply
shape. `response_format_of` also reads /v1/completions' response_format: one parser, the same
400s."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

from prefixserve.errors import InvalidRequestError
from prefixserve.structured.spec import StructuredOutput
from prefixserve.tools import ToolFormat, ToolSpec, format_of_template
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
