"""Request logs: JSON Lines of OpenAI chat-completion or completion request bodies.

One JSON object per line (blank lines and lines starting with `#` are skipped). A line is
either a request body itself, or a wrapper record whose "body" key holds the body:

    {"model": "m", "messages": [...], "tools": [...]}                       # chat completion
    {"model": "m", "prompt": "text" | [token ids] | ["text", ...]}          # completion
    {"model": "m", "system": "text" | [text blocks], "messages": [...]}    # Anthropic Messages
    {"body": {...}, "timestamp": 1718000000.5, "tenant": "acme",
     "cache_salt": "s", "request_id": "r1", "response": {...}}             # wrapper

Optional fields, read from the wrapper first and then from the body:
  timestamp     number (seconds) or ISO-8601 string; when every record has one the log is
                replayed in timestamp order (stable), otherwise in file order.
  cache_salt    non-empty string isolating the request's cache, exactly as the engine does.
  tenant        used as the salt when cache_salt is absent (tenant "acme" -> salt "acme").
  request_id    (or "id") defaults to "line<N>".
  response      the OpenAI response object; choices[0].message.content or choices[0].text is
                the generated reply and usage.completion_tokens its length.
  output_tokens an int, the number of generated tokens when no response is logged.
  model         the body's model, so that the lint can say when it counts with another one.
Every message and tool becomes what the server's chat template reads, so a logged request lints
to the prompt tokens the engine counted for it: an Anthropic body's top-level `system` becomes
the first (system) message; its `tool_use` blocks an assistant's `tool_calls` and its
`tool_result` blocks `tool` messages (prefixserve.prompt.tool_blocks, the server's own
conversion); a tool given with `input_schema` becomes an OpenAI function tool; content given
as text parts is their texts joined by newlines; `cache_control` marks are dropped.
An image part as `prefixserve serve --request-log` writes it ({"type": "image", "prefixserve_image":
{"hash", "width", "height", "tokens", "format", "bytes", "sha256"}}, request_log.py) renders as the
server rendered the picture (Qwen2-VL's placeholder, expanded to its tokens by render.py) and its
tokens are keyed by its content hash; an image part as a client sent it (no record of its tokens)
cannot be linted.
`prefixserve serve --request-log PATH` writes wrapper records.
A completion body whose prompt is a list of strings becomes one request per string
(ids "<id>#0", "<id>#1", ...).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Optional, Union

from prefixserve.errors import InvalidRequestError
from prefixserve.prompt.conversation import IMAGE_PLACEHOLDER
from prefixserve.prompt.tool_blocks import has_tool_blocks, tool_turns


class LogFormatError(ValueError):
    """A log line that is not a request this module understands; the message names the line."""


@dataclass(frozen=True)
class LoggedImage:
    """One picture of a logged request, as the server recorded it (request_log.py)."""
    content_hash: str          # hex: what the cache keys the picture's blocks by
    tokens: int                # its tokens in the prompt
    width: int                 # as decoded
    height: int
    format: Optional[str]      # its encoding (PNG, JPEG, ...)
    sha256: Optional[str]      # of its encoded bytes
    where: str                 # the part holding it: messages[i].content[j]


@dataclass
class LogRecord:
    request_id: str
    line: int                                   # 1-based line number in the log
    messages: Optional[list[dict]] = None       # chat completion
    tools: Optional[list[dict]] = None
    prompt: Union[str, list[int], None] = None  # completion: text or token ids
    chat_template_kwargs: dict = field(default_factory=dict)
    cache_salt: Optional[str] = None
    tenant: Optional[str] = None
    timestamp: Optional[float] = None
    output_text: Optional[str] = None
    output_tokens: Optional[int] = None
    model: Optional[str] = None
    images: tuple[LoggedImage, ...] = ()        # in prompt order

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("a LogRecord needs exactly one of messages (chat) or prompt (completion)")

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


def read_log(path: Union[str, Path]) -> list[LogRecord]:
    """Every request of the log at `path`, in replay order."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"request log not found: {path}")
    records: list[LogRecord] = []
    with path.open(encoding="utf-8") as fh:
        for number, raw in enumerate(fh, start=1):
            text = raw.strip()
            if not text or text.startswith("#"):
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise LogFormatError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
            records.extend(parse_record(obj, number, where=f"{path}:{number}"))
    if not records:
        raise LogFormatError(f"{path}: no requests in the log")
    return order_records(records)


def order_records(records: list[LogRecord]) -> list[LogRecord]:
    if all(r.timestamp is not None for r in records):
        return sorted(records, key=lambda r: r.timestamp)
    return records


def parse_record(obj: Any, line: int, where: str = "") -> list[LogRecord]:
    """The request(s) of one parsed log line."""
    where = where or f"line {line}"
    if not isinstance(obj, dict):
        raise LogFormatError(f"{where}: a record must be a JSON object, got {type(obj).__name__}")
    body = obj.get("body", obj)
    if not isinstance(body, dict):
        raise LogFormatError(f"{where}: 'body' must be a JSON object")

    def pick(*keys: str) -> Any:
        for key in keys:
            for source in (obj, body):
                if source.get(key) is not None:
                    return source[key]
        return None

    request_id = str(pick("request_id", "id") or f"line{line}")
    salt = pick("cache_salt")
    tenant = pick("tenant")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise LogFormatError(f"{where}: cache_salt must be a non-empty string, got {salt!r}")
    if tenant is not None and (not isinstance(tenant, str) or not tenant):
        raise LogFormatError(f"{where}: tenant must be a non-empty string, got {tenant!r}")
    model = body.get("model")
    common = dict(
        line=line, model=model if isinstance(model, str) else None,
        cache_salt=salt if salt is not None else tenant, tenant=tenant,
        timestamp=_timestamp(pick("timestamp"), where),
        output_text=_output_text(obj.get("response"), where),
        output_tokens=_output_tokens(obj, where))

    if "messages" in body:
        if "prompt" in body:
            raise LogFormatError(f"{where}: a request has either 'messages' or 'prompt', not both")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise LogFormatError(f"{where}: chat_template_kwargs must be an object")
        images: list[LoggedImage] = []
        messages = _messages(body["messages"], where, images)
        if body.get("system") is not None:
            messages = [_system_message(body["system"], where), *messages]
        return [LogRecord(request_id=request_id, messages=messages,
                          tools=_tools(body.get("tools"), where),
                          chat_template_kwargs=dict(kwargs), images=tuple(images), **common)]
    if "prompt" in body:
        prompt = body["prompt"]
        if isinstance(prompt, str):
            return [LogRecord(request_id=request_id, prompt=prompt, **common)]
        if isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if any(t < 0 for t in prompt):
                raise LogFormatError(f"{where}: token ids must be >= 0")
            return [LogRecord(request_id=request_id, prompt=list(prompt), **common)]
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            return [LogRecord(request_id=f"{request_id}#{k}", prompt=p, **common)
                    for k, p in enumerate(prompt)]
        raise LogFormatError(
            f"{where}: 'prompt' must be a string, a non-empty list of token ids or of strings")
    raise LogFormatError(f"{where}: neither 'messages' (chat completion) nor 'prompt' "
                         "(completion) found in the request body")


def _messages(value: Any, where: str, images: list[LoggedImage]) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise LogFormatError(f"{where}: 'messages' must be a non-empty list")
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise LogFormatError(f"{where}: messages[{i}] must be an object with a string 'role'")
        content = msg.get("content")
        if has_tool_blocks(content):
            try:
                out += [turn.template_message() for turn in tool_turns(msg["role"], content, f"messages[{i}]")]
            except InvalidRequestError as exc:
                raise LogFormatError(f"{where}: {exc}") from None
            continue
        # as the server builds a message: no marks, no null fields
        msg = {k: v for k, v in msg.items() if v is not None and k != "cache_control"}
        if isinstance(content, list):
            msg["content"] = _text_of_parts(content, f"{where}: messages[{i}].content", images,
                                            f"messages[{i}].content")
        elif content is not None and not isinstance(content, str):
            raise LogFormatError(f"{where}: messages[{i}].content must be a string or a list of parts")
        out.append(msg)
    return out


def _logged_image(value: Any, where: str, part: str) -> LoggedImage:
    if not isinstance(value, dict):
        raise LogFormatError(f"{where}.prefixserve_image must be an object")
    digest, tokens = value.get("hash"), value.get("tokens")
    if not isinstance(digest, str) or len(digest) != 32:
        raise LogFormatError(f"{where}.prefixserve_image.hash must be 32 hex digits, got {digest!r}")
    try:
        bytes.fromhex(digest)
    except ValueError:
        raise LogFormatError(f"{where}.prefixserve_image.hash must be 32 hex digits, got {digest!r}") from None
    for key in ("tokens", "width", "height"):
        v = value.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise LogFormatError(f"{where}.prefixserve_image.{key} must be a positive int, got {v!r}")
    fmt, sha = value.get("format"), value.get("sha256")
    return LoggedImage(digest, tokens, value["width"], value["height"],
                       fmt if isinstance(fmt, str) else None, sha if isinstance(sha, str) else None, part)


def _system_message(value: Any, where: str) -> dict:
    """An Anthropic body's top-level system prompt: a string or a list of text blocks."""
    if isinstance(value, list):
        return {"role": "system", "content": _text_of_parts(value, f"{where}: system")}
    if not isinstance(value, str):
        raise LogFormatError(f"{where}: 'system' must be a string or a list of text blocks")
    return {"role": "system", "content": value}


def _text_of_parts(parts: list, where: str, images: Optional[list[LoggedImage]] = None,
                   field_name: str = "") -> str:
    texts = []
    for j, part in enumerate(parts):
        if images is not None and isinstance(part, dict) and part.get("type") == "image" \
                and "prefixserve_image" in part:
            images.append(_logged_image(part["prefixserve_image"], f"{where}[{j}]", f"{field_name}[{j}]"))
            texts.append(IMAGE_PLACEHOLDER)
            continue
        if isinstance(part, dict) and part.get("type") in ("image_url", "image", "input_image"):
            raise LogFormatError(f"{where}[{j}]: an image part as the client sent it; only a log written "
                                 "by `prefixserve serve --request-log` records what the picture was")
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                part.get("text"), str):
            raise LogFormatError(f"{where}[{j}]: only text parts are supported, got {part!r:.80}")
        texts.append(part["text"])
    return "\n".join(texts)


def _tools(value: Any, where: str) -> Optional[list[dict]]:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise LogFormatError(f"{where}: 'tools' must be a list of objects")
    return [_openai_tool(t, f"{where}: tools[{i}]") for i, t in enumerate(value)] or None


def _openai_tool(tool: dict, where: str) -> dict:
    """The tool as the template reads it: OpenAI's shape, without its cache_control mark."""
    spec = {k: v for k, v in tool.items() if k != "cache_control"}
    if "input_schema" not in spec:
        return spec
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise LogFormatError(f"{where}.name must be a non-empty string")
    function = {"name": spec["name"]}
    if spec.get("description") is not None:
        function["description"] = spec["description"]
    function["parameters"] = spec["input_schema"]
    return {"type": "function", "function": function}


def _timestamp(value: Any, where: str) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            pass
    raise LogFormatError(f"{where}: timestamp must be seconds or an ISO-8601 string, got {value!r}")


def _output_text(response: Any, where: str) -> Optional[str]:
    if response is None:
        return None
    if not isinstance(response, dict):
        raise LogFormatError(f"{where}: 'response' must be an object")
    choices = response.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    message = choice.get("message")
    if isinstance(message, dict) and isinstance(message.get("content"), str):
        return message["content"]
    return choice.get("text") if isinstance(choice.get("text"), str) else None


def _output_tokens(obj: dict, where: str) -> Optional[int]:
    value = obj.get("output_tokens")
    if value is None:
        response = obj.get("response")
        usage = response.get("usage") if isinstance(response, dict) else None
        value = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise LogFormatError(f"{where}: output token count must be an int >= 0, got {value!r}")
    return value
