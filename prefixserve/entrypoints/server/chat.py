"""POST /v1/chat/completions: messages through the model's chat template, then generation."""
from __future__ import annotations

import time
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from prefixserve.engine.outputs import CompletionOutput, RequestOutput
from prefixserve.entrypoints.server.errors import APIError, bad_request, sampling_error
from prefixserve.entrypoints.server.generation import (DONE_EVENT, EventStream, Generation, sse,
                                                       submit, usage_of)
from prefixserve.entrypoints.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice,
                                                     ChatCompletionChunk, ChatCompletionRequest,
                                                     ChatCompletionResponse, ChatLogprobs,
                                                     ChatMessage, DeltaMessage, TokenLogprob,
                                                     TopLogprob)
from prefixserve.entrypoints.server.state import ServerState, get_state, new_id, token_text


async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = get_state(request)
    state.check_model(body.model)
    state.check_cache_salt(body.cache_salt)
    if body.logit_bias:
        raise bad_request("logit_bias is not supported", param="logit_bias", code="unsupported")
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    prompt = _render(state, body)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    try:
        params = body.sampling_params(max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
    except ValueError as exc:
        raise sampling_error(exc, renames={"logprobs": "top_logprobs"}) from None
    gen = await submit(state.async_llm, state.config, state.metrics, new_id("chatcmpl"), [prompt],
                       params, cache_salt=body.cache_salt, priority=body.priority, param="messages")
    created = int(time.time())
    if body.stream:
        return EventStream(_stream(state, gen, body, created), on_close=gen.abort)
    (output,) = await gen.final_outputs(request)
    choices = [ChatChoice(index=c.index, message=AssistantMessage(content=c.text),
                          logprobs=_logprobs(state, c, 0), finish_reason=c.finish_reason,
                          stop_reason=c.stop_reason)
               for c in output.outputs]
    response = ChatCompletionResponse(id=gen.request_ids[0], created=created,
                                      model=state.model_name, choices=choices,
                                      usage=usage_of([output]))
    return JSONResponse(response.model_dump())


def _conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the template expects them: content a string, text parts joined by newlines."""
    conversation = []
    for i, message in enumerate(messages):
        entry = message.model_dump(exclude_none=True)
        if isinstance(message.content, list):
            texts = []
            for j, part in enumerate(message.content):
                if part.type != "text" or part.text is None:
                    raise bad_request(
                        f"messages[{i}].content[{j}]: only text parts "
                        f"{{'type': 'text', 'text': ...}} are supported, got type {part.type!r}",
                        param=f"messages[{i}].content[{j}]", code="unsupported")
                texts.append(part.text)
            entry["content"] = "\n".join(texts)
        conversation.append(entry)
    return conversation


def _render(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    conversation = _conversation(body.messages)
    try:
        token_ids = state.async_llm.tokenizer.apply_chat_template(
            conversation, tools=body.tools, add_generation_prompt=body.add_generation_prompt,
            tokenize=True, **(body.chat_template_kwargs or {}))
    except Exception as exc:  # template errors are the request's fault (roles, fields)
        raise bad_request(f"the chat template could not render these messages: {exc}",
                          param="messages") from None
    return list(token_ids)


def _logprobs(state: ServerState, c: CompletionOutput, start: int) -> Optional[ChatLogprobs]:
    if c.logprobs is None:
        return None
    tokenizer = state.async_llm.tokenizer

    def top(token_id: int, logprob: float) -> TopLogprob:
        text = token_text(tokenizer, token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))

    content = []
    for token_id, (logprob, alternatives) in zip(c.token_ids[start:], c.logprobs[start:]):
        chosen = top(token_id, logprob)
        content.append(TokenLogprob(**chosen.model_dump(),
                                    top_logprobs=[top(t, lp) for t, lp in alternatives]))
    return ChatLogprobs(content=content)


async def _stream(state: ServerState, gen: Generation, body: ChatCompletionRequest,
                  created: int) -> AsyncIterator[str]:
    def chunk(choices: list[ChatChunkChoice]) -> str:
        return sse(ChatCompletionChunk(id=gen.request_ids[0], created=created,
                                       model=state.model_name, choices=choices))

    yield chunk([ChatChunkChoice(index=k, delta=DeltaMessage(role="assistant", content=""))
                 for k in range(body.n)])
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    done: set[int] = set()
    last: Optional[RequestOutput] = None
    try:
        async for _, out in gen.outputs():
            last = out
            choices = []
            for c in out.outputs:
                if c.index in done:
                    continue
                delta = c.text[sent_text.get(c.index, 0):]
                finished = c.finish_reason is not None
                if not delta and not finished:
                    continue
                choices.append(ChatChunkChoice(
                    index=c.index, delta=DeltaMessage(content=delta) if delta else DeltaMessage(),
                    logprobs=_logprobs(state, c, sent_tokens.get(c.index, 0)),
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason))
                sent_text[c.index] = len(c.text)
                sent_tokens[c.index] = len(c.token_ids)
                if finished:
                    done.add(c.index)
            if choices:
                yield chunk(choices)
    except APIError as exc:
        yield exc.sse()
        yield DONE_EVENT
        return
    if body.include_usage_in_stream and last is not None:
        yield sse(ChatCompletionChunk(id=gen.request_ids[0], created=created,
                                      model=state.model_name, choices=[], usage=usage_of([last])))
    yield DONE_EVENT
