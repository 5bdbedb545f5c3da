"""POST /v1/messages/count_tokens: the prompt tokens a Messages request would send to the model,
rendered exactly as /v1/messages renders it (its system prompt, tools and messages through the
chat template, a named cached content first, an agent loop's earlier turns in the tokens they were
generated as), so the count is the `input_tokens + cache_read_input_tokens +
cache_creation_input_tokens` that request reports."""
from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.responses import JSONResponse

from prefixserve.entrypoints.server.anthropic.conversation import messages_conversation
from prefixserve.entrypoints.server.anthropic.protocol import CountTokensRequest
from prefixserve.entrypoints.server.anthropic.tools import message_tools
from prefixserve.entrypoints.server.prompting.bodies import ChatKind, ParsedChat, chat_body, register_chat_kind
from prefixserve.entrypoints.server.rendering import prepare_prompt
from prefixserve.entrypoints.server.state import get_state, principal

COUNT_TOKENS = register_chat_kind(ChatKind("count_tokens", CountTokensRequest, messages_conversation,
                                           {"messages": [], "system": None}))


async def count_tokens(parsed: Annotated[ParsedChat, Depends(chat_body(COUNT_TOKENS.name))],
                       request: Request) -> JSONResponse:
    body: CountTokensRequest = parsed.body
    state = get_state(request)
    state.check_model(body.model)
    salt = state.namespace(request, body.cache_salt)
    message_tools(body, state.async_llm.tokenizer)   # the same refusals as /v1/messages
    prepared = await prepare_prompt(state, parsed.source, cached_content=body.cached_content, cache_salt=salt,
                                    tenant=principal(request).tenant)
    return JSONResponse({"input_tokens": len(prepared.token_ids)})
