"""A chat conversation as the renderer sees it: turns of text parts, tools, cache_control marks.

The server builds one from a request body (OpenAI or Anthropic shape), diagnose from a logged
request; both render it through prefixserve.prompt.render. Anthropic's
`cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}` may mark a text part or a tool.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

from prefixserve.errors import CacheControlError

# What a rendered prompt holds where an image part was (Qwen2-VL's tokens); the engine expands its
# <|image_pad|> to the image's tokens (multimodal/prompt.py).
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
# Anthropic's cache_control TTLs, then OpenAI's prompt_cache_breakpoint TTLs and its 24h retention
TTL_SECONDS = {"5m": 300.0, "1h": 3600.0, "30m": 1800.0, "12h": 43200.0, "24h": 86400.0}
_CONTROL_TTLS = ("5m", "1h")
MAX_BREAKPOINTS = 4
_CONTROL_KEYS = {"type", "ttl"}


@dataclass(frozen=True)
class CacheControl:
    ttl: str = "5m"
    # Token-exact (OpenAI's prompt_cache_breakpoint): the prefix is kept to the token, not
    # rounded down to a block boundary.
    exact: bool = False

    def __post_init__(self) -> None:
        if self.ttl not in TTL_SECONDS:
            raise ValueError(f"ttl must be one of {sorted(TTL_SECONDS)}, got {self.ttl!r}")


def parse_cache_control(raw: Any, where: str) -> Optional[CacheControl]:
    """The cache_control object of the element at `where` (None when absent)."""
    if raw is None:
        return None
    param = f"{where}.cache_control"
    if not isinstance(raw, dict):
        raise CacheControlError(f"{param} must be an object like {{\"type\": \"ephemeral\"}}, "
                                f"got {raw!r}", param=param)
    unknown = sorted(set(raw) - _CONTROL_KEYS)
    if unknown:
        raise CacheControlError(f"{param} has unknown fields {unknown}", param=param)
    if raw.get("type") != "ephemeral":
        raise CacheControlError(f"{param}.type must be \"ephemeral\", got {raw.get('type')!r}",
                                param=param)
    ttl = raw.get("ttl", "5m")
    if ttl not in _CONTROL_TTLS:
        raise CacheControlError(f"{param}.ttl must be \"5m\" or \"1h\", got {ttl!r}", param=param)
    return CacheControl(ttl)


@dataclass(frozen=True)
class ImageSource:
    """Where an image part's picture comes from, as sent: a URL (data:, http(s):, file:) or base64 data
    with its media type; fetched and decoded by the server (entrypoints/server/media.py)."""
    where: str                          # the body field, named when the image is refused
    part: str                           # the content part holding it
    url: Optional[str] = None
    data: Optional[str] = None          # base64
    media_type: Optional[str] = None
    # what the request asks of its resizing (media.pixel_bounds checks them against the model's): OpenAI's
    # detail ("low", "high", "auto") and prefixserve's min_pixels / max_pixels, named under `options_at`
    detail: Optional[str] = None
    min_pixels: Optional[int] = None
    max_pixels: Optional[int] = None
    options_at: str = ""


@dataclass
class Part:
    """One text part of a message (or one system block); an image part's text is IMAGE_PLACEHOLDER."""
    text: str
    cache_control: Optional[CacheControl] = None
    where: str = ""
    image: Optional[ImageSource] = None


@dataclass
class Turn:
    """One message: its template fields (role, name, tool_calls, ...) and its text parts."""
    fields: dict[str, Any]
    parts: Optional[list[Part]]  # None: no text content (the template sees fields as they are)

    def template_message(self, suffixes: Optional[dict[int, str]] = None) -> dict[str, Any]:
        """The message as the chat template reads it: text parts joined by newlines."""
        message = dict(self.fields)
        if self.parts is not None:
            suffixes = suffixes or {}
            message["content"] = "\n".join(p.text + suffixes.get(i, "")
                                           for i, p in enumerate(self.parts))
        return message


@dataclass
class Tool:
    spec: dict[str, Any]  # what the template renders (no cache_control in it)
    cache_control: Optional[CacheControl] = None
    where: str = ""


@dataclass
class Conversation:
    turns: list[Turn]
    tools: list[Tool] = field(default_factory=list)

    @classmethod
    def of_messages(cls, messages: list[dict[str, Any]],
                    tools: Optional[list[dict[str, Any]]] = None) -> Conversation:
        """OpenAI-style message dicts and tool specs, unmarked. A string content becomes one
        part; any other content (None, a list of blocks) stays in the fields untouched, so the
        template reads every message exactly as given."""
        turns = []
        for i, message in enumerate(messages):
            content = message.get("content")
            if isinstance(content, str):
                fields = {k: v for k, v in message.items() if k != "content"}
                turns.append(Turn(fields, [Part(content, None, f"messages[{i}]")]))
            else:
                turns.append(Turn(dict(message), None))
        return cls(turns, [Tool(spec, None, f"tools[{i}]") for i, spec in enumerate(tools or [])])

    def marks(self) -> list[tuple[str, CacheControl]]:
        """(where, control) of every mark, in the order tools -> system -> messages."""
        found = [(t.where, t.cache_control) for t in self.tools if t.cache_control is not None]
        for turn in self.turns:
            found += [(p.where, p.cache_control) for p in turn.parts or ()
                      if p.cache_control is not None]
        return found

    def check_marks(self) -> None:
        marks = self.marks()
        if len(marks) > MAX_BREAKPOINTS:
            wheres = ", ".join(w for w, _ in marks)
            raise CacheControlError(
                f"a request may set at most {MAX_BREAKPOINTS} cache_control breakpoints; this one "
                f"sets {len(marks)} ({wheres})", param=marks[MAX_BREAKPOINTS][0] + ".cache_control")

    def unmarked(self) -> Conversation:
        return Conversation(
            [Turn(t.fields, None if t.parts is None else [replace(p, cache_control=None)
                                                          for p in t.parts]) for t in self.turns],
            [replace(t, cache_control=None) for t in self.tools])

    def then(self, other: Conversation) -> Conversation:
        """This conversation followed by other's turns (other's tools must be empty)."""
        return Conversation(self.turns + other.turns, self.tools)
