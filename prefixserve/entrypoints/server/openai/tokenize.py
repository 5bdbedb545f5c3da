"""POST /tokenize and /detokenize in vLLM's shapes: a prompt's token ids (and their count, and the
longest prompt the server takes) as the generation endpoints would send them to the model. A
`prompt` is tokenized as /v1/completions tokenizes it; `messages` render through the chat template
exactly as /v1/chat/completions renders them (an agent loop's earlier turns in the tokens they
were generated as)."""
from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.responses import JSONResponse

from prefixserve.entrypoints.server.errors import bad_request
from prefixserve.entrypoints.server.openai.conversation import chat_conversation
from prefixserve.entrypoints.server.openai.protocol import DetokenizeRequest, TokenizeRequest
from prefixserve.entrypoints.server.prompting.bodies import json_body
from prefixserve.entrypoints.server.rendering import prepare_prompt
from prefixserve.entrypoints.server.state import get_state, principal, token_text


async def tokenize(body: Annotated[TokenizeRequest, Depends(json_body(TokenizeRequest))],
                   request: Request) -> JSONResponse:
    state = get_state(request)
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give either prompt or messages", param="prompt" if body.prompt is None else "messages")
    if body.prompt is not None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        (tokens,) = await state.renderer.encode([body.prompt], add_special_tokens=special)
    else:
        if body.add_special_tokens:
            raise bad_request("add_special_tokens applies to a prompt; the chat template writes the special "
                              "tokens of messages", param="add_special_tokens")
        prepared = await prepare_prompt(state, chat_conversation(body.messages, body.tools), cached_content=None,
                                        cache_salt=state.namespace(request, body.cache_salt),
                                        tenant=principal(request).tenant,
                                        add_generation_prompt=body.add_generation_prompt,
                                        template_kwargs=body.chat_template_kwargs)
        tokens = prepared.token_ids
    tokenizer = state.async_llm.tokenizer
    return JSONResponse({"count": len(tokens), "max_model_len": state.async_llm.max_model_len, "tokens": tokens,
                         "token_strs": [token_text(tokenizer, t) for t in tokens] if body.return_token_strs
                         else None})


async def detokenize(body: Annotated[DetokenizeRequest, Depends(json_body(DetokenizeRequest))],
                     request: Request) -> JSONResponse:
    state = get_state(request)
    state.check_model(body.model)
    tokenizer = state.async_llm.tokenizer
    for i, token in enumerate(body.tokens):
        if not 0 <= token < tokenizer.vocab_size:
            raise bad_request(f"tokens[{i}] = {token} is not a token id (0 to {tokenizer.vocab_size - 1})",
                              param=f"tokens[{i}]")
    return JSONResponse({"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)})
