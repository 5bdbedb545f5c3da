"""A request's tools and tool_choice (OpenAI or Anthropic shape), checked, and the grammar that
makes the model write a call when the choice demands one.

"auto" leaves the model free and parses whatever calls it writes; "none" parses nothing (the
tools are still rendered, so the prompt stays the same as on turns that allow calls);
"required" (Anthropic "any") and a named function constrain decoding to the model's own call
format with the arguments matching the function's parameter schema, one call or, when parallel
calls are allowed, several.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional

from prefixserve.errors import InvalidRequestError
from prefixserve.structured.grammar import lark_json
from prefixserve.structured.spec import StructuredOutput
from prefixserve.tools.calls import QWEN_CLOSE, QWEN_OPEN, ToolFormat, ToolSpec

# OpenAI's rule for function names; it also keeps names safe to write into a grammar literal.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128


@dataclass(frozen=True)
class ToolChoice:
    mode: Literal["auto", "none", "required", "named"]
    name: Optional[str] = None
    parallel: bool = True

    @property
    def parses_calls(self) -> bool:
        return self.mode != "none"


def tool_specs_of(tools: Optional[list[dict[str, Any]]], param: str = "tools") -> list[ToolSpec]:
    """Tools in the template's (OpenAI) shape -> specs; InvalidRequestError naming the field."""
    specs: list[ToolSpec] = []
    if len(tools or ()) > MAX_TOOLS:
        raise InvalidRequestError(f"at most {MAX_TOOLS} tools", param=param)
    for i, tool in enumerate(tools or ()):
        where = f"{param}[{i}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(function, dict):
            raise InvalidRequestError(f"{where} must be {{\"type\": \"function\", \"function\": "
                                      f"{{\"name\": ..., \"parameters\": {{...}}}}}}", param=where)
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidRequestError(f"{where}: a function name is 1-64 letters, digits, _ or -, "
                                      f"got {str(name)[:80]!r}", param=f"{where}.function.name")
        parameters = function.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict):
            raise InvalidRequestError(f"{where}: parameters must be a JSON schema object",
                                      param=f"{where}.function.parameters")
        if name in {s.name for s in specs}:
            raise InvalidRequestError(f"{where}: two tools are named {name!r}", param=f"{where}.function.name")
        specs.append(ToolSpec(name, parameters))
    return specs


def tool_choice_of(raw: Any, specs: list[ToolSpec], *, parallel: Optional[bool] = None,
                   param: str = "tool_choice") -> ToolChoice:
    """OpenAI's tool_choice ("auto", "none", "required", {"type": "function", "function":
    {"name"}}) or Anthropic's ({"type": "auto" | "any" | "tool" | "none", "name",
    "disable_parallel_tool_use"})."""
    allow_parallel = True if parallel is None else parallel
    if raw is None:
        return ToolChoice("auto" if specs else "none", parallel=allow_parallel)
    if isinstance(raw, str) and raw in ("auto", "none", "required"):
        mode, name = raw, None
    elif isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("function"), dict):
        mode, name = "named", raw["function"].get("name")
    elif isinstance(raw, dict) and raw.get("type") in ("auto", "any", "tool", "none"):
        mode = {"any": "required", "tool": "named"}.get(raw["type"], raw["type"])
        name = raw.get("name")
        disable = raw.get("disable_parallel_tool_use", False)
        if not isinstance(disable, bool):
            raise InvalidRequestError("disable_parallel_tool_use must be a boolean",
                                      param=f"{param}.disable_parallel_tool_use")
        allow_parallel = not disable
    else:
        raise InvalidRequestError(f"{param} must be \"auto\", \"none\", \"required\" or name a "
                                  f"function, got {str(raw)[:80]!r}", param=param)
    if mode in ("required", "named") and not specs:
        raise InvalidRequestError(f"{param} {mode!r} needs tools", param=param)
    if mode == "named" and name not in {s.name for s in specs}:
        raise InvalidRequestError(f"{param} names {str(name)[:80]!r}, which is not among the tools",
                                  param=param)
    return ToolChoice(mode, name, allow_parallel)


def call_grammar(choice: ToolChoice, specs: list[ToolSpec], fmt: ToolFormat,
                 single_token_id: Callable[[str], Optional[int]]) -> Optional[StructuredOutput]:
    """The grammar a forced choice puts on the output (None for "auto" and "none").

    single_token_id(text) -> the id of a token spelling exactly `text`, if the vocabulary has
    one: the call tags are then matched as that token, the tokenization the template's rendering
    of the call gives, so the model's call re-renders into the same tokens on the next turn."""
    if choice.mode not in ("required", "named"):
        return None
    offered = [s for s in specs if choice.mode == "required" or s.name == choice.name]
    rules = []
    for i, spec in enumerate(offered):
        schema = dict(spec.parameters)
        schema.setdefault("type", "object")
        if fmt == "llama3":
            head = json.dumps('{"name": ' + json.dumps(spec.name) + ', "parameters": ')
            rules.append(f"call_{i}: {head} args_{i} \"}}\"")
        else:
            head = json.dumps("\n" + '{"name": ' + json.dumps(spec.name) + ', "arguments": ')
            rules.append(f"call_{i}: {_tag(QWEN_OPEN, single_token_id)} {head} args_{i} "
                         f"\"}}\\n\" {_tag(QWEN_CLOSE, single_token_id)}")
        rules.append(f"args_{i}: {lark_json(schema)}")
    separator = '"; "' if fmt == "llama3" else '"\\n"'
    start = f"start: call ({separator} call)*" if choice.parallel else "start: call"
    alternatives = " | ".join(f"call_{i}" for i in range(len(offered)))
    return StructuredOutput("lark", "\n".join(["%llguidance {}", start, f"call: {alternatives}", *rules]))


def _tag(text: str, single_token_id: Callable[[str], Optional[int]]) -> str:
    token = single_token_id(text)
    return f"<[{token}]>" if token is not None else json.dumps(text)
