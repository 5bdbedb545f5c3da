"""Request body of the Anthropic Messages API subset served at POST /v1/messages.

Validation is strict like the OpenAI bodies (no coercion); unknown fields are refused at any
depth (fields.py), and Anthropic's fields that prefixserve does not implement are either ignored
or refused, one by one (docs/api-fields.md).
Responses are built as plain dicts in messages.py, in Anthropic's wire format.
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import ConfigDict, Field

from prefixserve.entrypoints.server.fields import Shape, Unsupported
from prefixserve.entrypoints.server.protocol import DiagnoseFields, StrictModel


class ContentBlock(StrictModel):
    # Other block kinds (image, tool_use, ...) parse here and are refused with a clear message.
    model_config = ConfigDict(strict=True, extra="allow")
    # the fields of Anthropic's text, image, document, tool_use, tool_result and thinking blocks
    known_extra: ClassVar[frozenset[str]] = frozenset({
        "citations", "source", "title", "context", "id", "name", "input", "tool_use_id", "content",
        "is_error", "thinking", "signature", "data",
        # prefixserve's resizing bounds of an image block (media.pixel_bounds)
        "min_pixels", "max_pixels"})
    type: str
    text: Optional[str] = None
    cache_control: Optional[dict[str, Any]] = None


class AnthropicMessage(StrictModel):
    role: Literal["user", "assistant"]
    content: Union[str, list[ContentBlock]]


def _thinking_off(thinking: Any) -> bool:
    return thinking is None or (isinstance(thinking, dict) and thinking.get("type") == "disabled")


class MessagesRequest(DiagnoseFields):
    unsupported: ClassVar[dict[str, Unsupported]] = {
        "thinking": Unsupported('extended thinking is not implemented ({"type": "disabled"} is accepted)',
                                _thinking_off),
        "container": Unsupported("this server runs no code-execution containers"),
        "mcp_servers": Unsupported("this server connects to no MCP servers"),
        "output_config": Unsupported("output formats and effort are not implemented"),
    }
    field_keys: ClassVar[dict[str, Shape]] = {
        "tools": {"type": None, "name": None, "description": None, "input_schema": None,
                  "cache_control": None, "strict": None},
        "tool_choice": {"type": None, "name": None, "disable_parallel_tool_use": None},
        "metadata": {"user_id": None},
    }
    model: str
    max_tokens: int
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Union[str, list[ContentBlock], None] = None
    tools: Optional[list[dict[str, Any]]] = None
    # {"type": "auto" | "any" | "tool" | "none", "name", "disable_parallel_tool_use"}
    tool_choice: Optional[dict[str, Any]] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    stop_sequences: Optional[list[str]] = None
    stream: bool = False
    # Accepted and ignored (docs/api-fields.md): an end-user id, and where or how fast
    # Anthropic would serve the request.
    metadata: Optional[dict[str, Any]] = None
    service_tier: Optional[str] = None
    inference_geo: Optional[str] = None
    speed: Optional[str] = None
    # Automatic caching: a breakpoint on the last block of the request.
    cache_control: Optional[dict[str, Any]] = None
    # prefixserve extensions, as on the OpenAI endpoints.
    priority: int = 0
    cache_salt: Optional[str] = None
    cached_content: Optional[str] = None


class CountTokensRequest(DiagnoseFields):
    """POST /v1/messages/count_tokens: what a Messages request's prompt is made of, without
    max_tokens or sampling (diagnose fields are accepted and change nothing here)."""
    unsupported: ClassVar[dict[str, Unsupported]] = {
        "thinking": MessagesRequest.unsupported["thinking"],
        "mcp_servers": MessagesRequest.unsupported["mcp_servers"],
        "output_config": MessagesRequest.unsupported["output_config"],
    }
    field_keys: ClassVar[dict[str, Shape]] = MessagesRequest.field_keys
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Union[str, list[ContentBlock], None] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[dict[str, Any]] = None
    cache_control: Optional[dict[str, Any]] = None
    cache_salt: Optional[str] = None
    cached_content: Optional[str] = None
