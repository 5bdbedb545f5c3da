"""Request bodies -> Conversation: what both APIs' conversations are built from (text parts,
tools in either shape) and Anthropic-shaped system/messages, which the Messages endpoint and named
cached contents both take. OpenAI's chat messages are openai/conversation.py's.

Text parts of one message are joined by newlines for the template; each part (and each
tool) may carry a cache_control mark, which is taken off before the template sees it.
"""
from __future__ import annotations

from typing import Any, Optional, Union

from prefixserve.prompt import Conversation, Part, Tool, Turn, parse_cache_control
from prefixserve.prompt.conversation import IMAGE_PLACEHOLDER, ImageSource
from prefixserve.entrypoints.server.errors import bad_request
from prefixserve.prompt.tool_blocks import has_tool_blocks, tool_turns


def parts_of(content: Union[str, list, None], where: str) -> Optional[list[Part]]:
    """The parts of a message's content (a string or a list of text and image blocks)."""
    if content is None:
        return None
    if isinstance(content, str):
        return [Part(content, None, where)]
    parts = []
    for j, block in enumerate(content):
        block_where = f"{where}[{j}]"
        if hasattr(block, "model_dump"):
            block = block.model_dump(exclude_none=True)
        image = image_of(block, block_where)
        if image is not None:
            parts.append(Part(IMAGE_PLACEHOLDER, parse_cache_control(block.get("cache_control"), block_where),
                              block_where, image))
            continue
        if not isinstance(block, dict) or block.get("type") != "text" or \
                not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise bad_request(f"{block_where}: only text blocks {{'type': 'text', 'text': ...}} are "
                              f"supported, got type {kind!r}", param=block_where, code="unsupported")
        parts.append(Part(block["text"], parse_cache_control(block.get("cache_control"), block_where),
                          block_where))
    return parts


def image_of(block: Any, where: str) -> Optional[ImageSource]:
    """An OpenAI image_url part ({"image_url": {"url"}}) or an Anthropic image block with a base64 or url
    source, as sent; None for any other block."""
    if not isinstance(block, dict):
        return None
    if block.get("type") == "image_url":
        ref = block.get("image_url")
        url = ref.get("url") if isinstance(ref, dict) else None
        if not isinstance(url, str) or not url:
            raise bad_request(f"{where}.image_url.url must be a non-empty string", param=f"{where}.image_url.url")
        detail = ref.get("detail")
        if detail is not None and detail not in ("auto", "low", "high"):
            raise bad_request(f"{where}.image_url.detail must be \"auto\", \"low\" or \"high\", got {detail!r}",
                              param=f"{where}.image_url.detail")
        return ImageSource(f"{where}.image_url.url", where, url=url, detail=detail,
                           **_pixels(ref, f"{where}.image_url"))
    if block.get("type") == "image":
        source = block.get("source")
        if not isinstance(source, dict):
            raise bad_request(f"{where}.source must be an object", param=f"{where}.source")
        if source.get("type") == "base64" and isinstance(source.get("data"), str) \
                and isinstance(source.get("media_type"), str):
            return ImageSource(f"{where}.source", where, data=source["data"], media_type=source["media_type"],
                               **_pixels(block, where))
        if source.get("type") == "url" and isinstance(source.get("url"), str):
            return ImageSource(f"{where}.source.url", where, url=source["url"], **_pixels(block, where))
        raise bad_request(f"{where}.source must be {{'type': 'base64', 'media_type', 'data'}} or "
                          f"{{'type': 'url', 'url'}}", param=f"{where}.source")
    return None


def _pixels(holder: dict, where: str) -> dict[str, Any]:
    """prefixserve's min_pixels / max_pixels beside an image (positive integers; the model's bounds are
    checked once the model is known: media.pixel_bounds)."""
    out: dict[str, Any] = {"options_at": where}
    for name in ("min_pixels", "max_pixels"):
        value = holder.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise bad_request(f"{where}.{name} must be a positive integer, got {value!r}", param=f"{where}.{name}")
        out[name] = value
    return out


def tool_of(raw: Any, where: str) -> Tool:
    """A tool in OpenAI's shape ({"type": "function", "function": {...}}) or Anthropic's
    ({"name", "description", "input_schema"}); the template always sees OpenAI's."""
    if not isinstance(raw, dict):
        raise bad_request(f"{where} must be an object, got {type(raw).__name__}", param=where)
    control = parse_cache_control(raw.get("cache_control"), where)
    spec = {k: v for k, v in raw.items() if k != "cache_control"}
    if "input_schema" in spec:
        if not isinstance(spec.get("name"), str) or not spec["name"]:
            raise bad_request(f"{where}.name must be a non-empty string", param=f"{where}.name")
        function = {"name": spec["name"]}
        if spec.get("description") is not None:
            function["description"] = spec["description"]
        function["parameters"] = spec["input_schema"]
        spec = {"type": "function", "function": function}
    return Tool(spec, control, where)


def conversation_of(system: Union[str, list, None], messages: list[Any],
                    tools: Optional[list[Any]]) -> Conversation:
    """Anthropic-shaped input: a system prompt (string or text blocks) and role/content messages."""
    turns = []
    if system is not None:
        turns.append(Turn({"role": "system"}, parts_of(system, "system")))
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if hasattr(message, "model_dump"):
            message = message.model_dump(exclude_none=True)
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(f"{where} needs a string role", param=f"{where}.role")
        if not isinstance(message.get("content"), (str, list)):
            raise bad_request(f"{where}.content must be a string or a list of text blocks",
                              param=f"{where}.content")
        if has_tool_blocks(message["content"]):
            turns += tool_turns(message["role"], message["content"], where)
            continue
        fields = {"role": message["role"]}
        turns.append(Turn(fields, parts_of(message["content"], f"{where}.content")))
    return Conversation(turns, [tool_of(t, f"tools[{i}]") for i, t in enumerate(tools or [])])

