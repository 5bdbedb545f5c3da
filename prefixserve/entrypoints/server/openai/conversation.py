"""A chat-completions body -> Conversation: OpenAI chat messages (string or text-part content,
a message-level cache_control on string content) and tools. Registered as the "chat" kind of
body, so the render process can parse large ones (prompting/bodies.py)."""
from __future__ import annotations

from typing import Any, Optional

from prefixserve.entrypoints.server.openai.protocol import ChatCompletionRequest, ChatMessage
from prefixserve.entrypoints.server.openai.tool_calls import check_tool_calls
from prefixserve.entrypoints.server.prompting.bodies import ChatKind, register_chat_kind
from prefixserve.entrypoints.server.prompt_cache_fields import PromptCacheFields, request_cache_fields
from prefixserve.entrypoints.server.prompting.conversations import parts_of, tool_of
from prefixserve.errors import CacheControlError
from prefixserve.prompt import Conversation, Turn, parse_cache_control


def chat_conversation(messages: list[ChatMessage], tools: Optional[list[dict[str, Any]]],
                      cache: PromptCacheFields = PromptCacheFields()) -> Conversation:
    turns = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        fields = message.model_dump(exclude_none=True)
        fields.pop("content", None)
        check_tool_calls(message.role, fields.get("tool_calls"), f"{where}.tool_calls")
        control = parse_cache_control(fields.pop("cache_control", None), where)
        if control is not None and not isinstance(message.content, str):
            raise CacheControlError(f"{where}.cache_control on a message needs string content; "
                                    f"mark one of its content parts instead",
                                    param=f"{where}.cache_control")
        content_where = where if isinstance(message.content, str) else f"{where}.content"
        parts = parts_of(message.content, content_where)
        if control is not None:
            parts[0].cache_control = control
        if isinstance(message.content, list) and parts is not None:
            _mark_exact(message.content, parts, cache, content_where)
        turns.append(Turn(fields, parts))
    return Conversation(turns, [tool_of(t, f"tools[{i}]") for i, t in enumerate(tools or [])])


def _mark_exact(content: list, parts: list, cache: PromptCacheFields, where: str) -> None:
    """Puts each part's prompt_cache_breakpoint on it as a token-exact mark."""
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        mark = cache.mark((block.model_extra or {}).get("prompt_cache_breakpoint"), at)
        if mark is None:
            continue
        if parts[j].cache_control is not None:
            raise CacheControlError(f"{at} has both cache_control and prompt_cache_breakpoint; "
                                    "mark it with one", param=f"{at}.prompt_cache_breakpoint")
        parts[j].cache_control = mark


def openai_conversation(body: Any) -> Conversation:
    """A chat-completions body's conversation."""
    cache = request_cache_fields(body)
    return chat_conversation(body.messages, body.tools, cache)


CHAT = register_chat_kind(ChatKind("chat", ChatCompletionRequest, openai_conversation, {"messages": []}))
