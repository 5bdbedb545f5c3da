"""Response items: a request's `input` checked and normalized into the items a response stores,
and a conversation's items (the stored history, then the new input) turned into the Conversation
the chat template renders.

Items render as chat completions' messages would, so a Responses agent loop and a chat agent loop
write the same prompt: an assistant message and the function_call items right after it are one
assistant turn with tool_calls (the model wrote them as one output), a function_call_output is a
tool message. Every function call's arguments stay the exact text the model wrote, and an
assistant message's text the exact text it answered, so an earlier turn re-renders into the
tokens it was generated as (prompting/turn_memory.py then keeps even their tokenization).
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Optional, Union

from prefixserve.entrypoints.server.errors import bad_request
from prefixserve.entrypoints.server.prompt_cache_fields import PromptCacheFields
from prefixserve.prompt import Conversation, Part, Tool, Turn
from prefixserve.prompt.conversation import IMAGE_PLACEHOLDER, ImageSource

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text")
IMAGE_PART = "input_image"


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def normalize_input(raw: Union[str, list, None], history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input as stored items, each with an id and a status; a function_call_output
    must answer a function_call of the history or of this input."""
    if raw is None:
        raise bad_request("input is required", param="input", code="missing_required_parameter")
    if isinstance(raw, str):
        raw = [{"role": "user", "content": raw}]
    if not raw:
        raise bad_request("input must hold at least one item", param="input")
    calls = {item["call_id"] for item in history if item["type"] == "function_call"}
    items = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        kind = kind if isinstance(kind, str) else None
        if kind == "message":
            items.append(_message(item, where))
        elif kind == "function_call":
            call = _function_call(item, where)
            calls.add(call["call_id"])
            items.append(call)
        elif kind == "function_call_output":
            output = _function_call_output(item, where)
            if output["call_id"] not in calls:
                raise bad_request(f"{where}.call_id {output['call_id'][:80]!r} answers no function_call "
                                  f"of this conversation", param=f"{where}.call_id", code="unknown_call_id")
            items.append(output)
        else:
            raise bad_request(f"{where}.type must be \"message\", \"function_call\" or "
                              f"\"function_call_output\", got {str(kind)[:40]!r}", param=f"{where}.type",
                              code="unsupported")
    return items


def _string(item: dict[str, Any], key: str, where: str, allow_empty: bool = False) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (not value and not allow_empty):
        raise bad_request(f"{where}.{key} must be a {'' if allow_empty else 'non-empty '}string",
                          param=f"{where}.{key}")
    return value


def _parts(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "input_text", "text": content}]
    if not isinstance(content, list) or not content:
        raise bad_request(f"{where} must be a string or a non-empty list of text parts", param=where)
    parts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if isinstance(part, dict) and part.get("type") == IMAGE_PART:
            parts.append(_image(part, at))
            continue
        if not isinstance(part, dict) or not isinstance(part.get("type"), str) or part["type"] not in TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"{at}: only input_text, output_text and input_image parts are supported, got "
                              f"{str(kind)[:40]!r}", param=f"{at}.type", code="unsupported")
        text = _string(part, "text", at, allow_empty=True)
        PromptCacheFields().mark(part.get("prompt_cache_breakpoint"), at)   # refused here, naming the part
        kept = {"type": part["type"], "text": text}
        if part.get("prompt_cache_breakpoint") is not None:
            kept["prompt_cache_breakpoint"] = part["prompt_cache_breakpoint"]
        if part["type"] == "output_text":
            kept["annotations"] = []
        parts.append(kept)
    return parts


def _image(part: dict[str, Any], at: str) -> dict[str, Any]:
    """An input_image part by URL (a data: URL; http(s) and files as the server's media flags allow,
    checked when the picture is loaded); a file_id names nothing stored here."""
    if part.get("file_id") is not None:
        raise bad_request(f"{at}.file_id: this server stores no files; send the picture as image_url",
                          param=f"{at}.file_id", code="unsupported")
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise bad_request(f"{at}.image_url must be a non-empty string (a data: URL)", param=f"{at}.image_url")
    detail = part.get("detail", "auto")
    if detail not in ("auto", "low", "high"):
        raise bad_request(f"{at}.detail must be auto, low or high", param=f"{at}.detail")
    kept = {"type": IMAGE_PART, "image_url": url, "detail": detail}
    PromptCacheFields().mark(part.get("prompt_cache_breakpoint"), at)
    if part.get("prompt_cache_breakpoint") is not None:
        kept["prompt_cache_breakpoint"] = part["prompt_cache_breakpoint"]
    return kept


def _text_only(parts: list[dict[str, Any]], where: str, what: str) -> None:
    for j, part in enumerate(parts):
        if part["type"] == IMAGE_PART:
            raise bad_request(f"{where}[{j}]: {what} holds text only; pictures go in user messages",
                              param=f"{where}[{j}].type", code="unsupported")


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}, got {str(role)[:40]!r}",
                          param=f"{where}.role")
    parts = _parts(item.get("content"), f"{where}.content")
    if role != "user":
        _text_only(parts, f"{where}.content", f"a {role} message")
    if role == "assistant":
        parts = [{**p, "type": "output_text", "annotations": []} for p in parts]
    return {"id": _given_id(item, where, "msg"), "type": "message", "role": role, "content": parts,
            "status": "completed"}


def _given_id(item: dict[str, Any], where: str, prefix: str) -> str:
    given = item.get("id")
    if given is None:
        return item_id(prefix)
    if not isinstance(given, str) or not 0 < len(given) <= 128:
        raise bad_request(f"{where}.id must be a string of 1-128 characters", param=f"{where}.id")
    return given


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    arguments = _string(item, "arguments", where, allow_empty=True)
    try:
        if not isinstance(json.loads(arguments), dict):
            raise ValueError
    except (ValueError, RecursionError):
        raise bad_request(f"{where}.arguments must be the JSON text of an object",
                          param=f"{where}.arguments") from None
    return {"id": _given_id(item, where, "fc"), "type": "function_call",
            "call_id": _string(item, "call_id", where), "name": _string(item, "name", where),
            "arguments": arguments, "status": "completed"}


def _function_call_output(item: dict[str, Any], where: str) -> dict[str, Any]:
    output = item.get("output")
    if not isinstance(output, str):
        parts = _parts(output, f"{where}.output") if isinstance(output, list) else None
        if parts is None:
            raise bad_request(f"{where}.output must be a string or a list of text parts",
                              param=f"{where}.output")
        _text_only(parts, f"{where}.output", "a function call's output")
        output = "\n".join(p["text"] for p in parts)
    return {"id": _given_id(item, where, "fco"), "type": "function_call_output",
            "call_id": _string(item, "call_id", where), "output": output, "status": "completed"}


def conversation_of(instructions: Optional[str], items: list[dict[str, Any]],
                    tools: list[dict[str, Any]], cache: PromptCacheFields) -> Conversation:
    """The conversation the template renders: instructions as the system message, then the items."""
    turns: list[Turn] = []
    if instructions is not None:
        turns.append(Turn({"role": "system"}, [Part(instructions, None, "instructions")]))
    for item in items:
        if item["type"] == "message":
            parts = [_part(p, cache) for p in item["content"]]
            turns.append(Turn({"role": ROLES[item["role"]]}, parts))
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = turns[-1] if turns else None
            if last is not None and last.fields["role"] == "assistant":
                last.fields.setdefault("tool_calls", []).append(call)
            else:
                turns.append(Turn({"role": "assistant", "tool_calls": [call]}, None))
        else:
            turns.append(Turn({"role": "tool", "tool_call_id": item["call_id"]},
                              [Part(item["output"], None, "input")]))
    return Conversation(turns, [Tool(t, None, f"tools[{i}]") for i, t in enumerate(tools)])


def _part(part: dict[str, Any], cache: PromptCacheFields) -> Part:
    mark = cache.mark(part.get("prompt_cache_breakpoint"), "input")
    if part["type"] == IMAGE_PART:
        # the picture is fetched, decoded and hashed when the prompt is prepared (media.py); a
        # stored turn's picture is loaded again on each continuation, and hits by its content hash
        # detail "low" caps its tokens as on the chat route (media.pixel_bounds)
        return Part(IMAGE_PLACEHOLDER, mark, "input", ImageSource("input.image_url", "input", url=part["image_url"],
                                                                  detail=part.get("detail"), options_at="input"))
    return Part(part["text"], mark, "input")


def chat_tools_of(tools: Optional[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Function tools in the Responses shape -> the chat shape the template and grammars read."""
    out = []
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if tool.get("type") != "function":
            raise bad_request(f"{where}.type: only function tools are supported, got "
                              f"{str(tool.get('type'))[:40]!r}", param=f"{where}.type", code="unsupported")
        function = {"name": _string(tool, "name", where)}
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Union[str, dict[str, Any], None]) -> Union[str, dict[str, Any], None]:
    """tool_choice in the Responses shape -> the chat shape (tools/choice.py checks the rest)."""
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise bad_request("tool_choice.type: only \"function\" is supported", param="tool_choice.type",
                              code="unsupported")
        if not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice.name must name a function", param="tool_choice.name")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def response_format_of(fmt: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """text.format -> chat's response_format."""
    if fmt is None or fmt.get("type") != "json_schema":
        return fmt
    if not isinstance(fmt.get("schema"), dict):
        raise bad_request("text.format.schema must be a JSON schema object", param="text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt["schema"]}}
