"""Request body of the Anthropic Messages API subset served at POST /v1/messages.

Validation is strict like the OpenAI bodies (no coercion); unknown fields are ignored.
Responses are built as plain dicts in messages.py, in Anthropic's wire format.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import ConfigDict, Field

from prefixserve.entrypoints.server.protocol import DiagnoseFields, StrictModel


class ContentBlock(StrictModel):
    # Other block kinds (image, tool_use, ...) parse here and are refused with a clear message.
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: Optional[str] = None
    cache_control: Optional[dict[str, Any]] = None


class AnthropicMessage(StrictModel):
    role: Literal["user", "assistant"]
    content: Union[str, list[ContentBlock]]


class MessagesRequest(DiagnoseFields):
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
    metadata: Optional[dict[str, Any]] = None
    # Automatic caching: a breakpoint on the last block of the request.
    cache_control: Optional[dict[str, Any]] = None
    # prefixserve extensions, as on the OpenAI endpoints.
    priority: int = 0
    cache_salt: Optional[str] = None
    cached_content: Optional[str] = None
