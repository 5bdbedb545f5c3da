"""A Messages body -> Conversation, registered as the "messages" kind of body, so the render
process can parse large ones (prompting/bodies.py)."""
from __future__ import annotations

from typing import Any

from prefixserve.entrypoints.server.anthropic.protocol import MessagesRequest
from prefixserve.entrypoints.server.prompting.bodies import ChatKind, register_chat_kind
from prefixserve.entrypoints.server.prompting.conversations import conversation_of
from prefixserve.prompt import Conversation, parse_cache_control


def messages_conversation(body: Any) -> Conversation:
    """A Messages body's conversation; a top-level cache_control marks the last block
    (Anthropic's automatic caching) unless that block has its own."""
    conversation = conversation_of(body.system, body.messages, body.tools)
    control = parse_cache_control(body.cache_control, "body")
    last = conversation.turns[-1].parts[-1] if conversation.turns and conversation.turns[-1].parts else None
    if control is not None and last is not None and last.cache_control is None:
        last.cache_control = control
    return conversation


MESSAGES = register_chat_kind(ChatKind("messages", MessagesRequest, messages_conversation,
                                       {"messages": [], "system": None}))
