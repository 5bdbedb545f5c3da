"""POST /v1/chat/completions: messages through the model's chat template, then generation."""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Annotated, AsyncIterator, Optional

from fastapi import Depends, Request
from fastapi.responses import JSONResponse, Response

from prefixserve.engine.outputs import CompletionOutput, RequestOutput
from prefixserve.entrypoints.server.diagnosis import (LiveDiagnosis, diagnose_ask,
                                                      with_diagnosis)
from prefixserve.entrypoints.server.errors import APIError, api_error, bad_request
from prefixserve.errors import InvalidRequestError
from prefixserve.entrypoints.server.streaming import DONE_EVENT, EventStream, Generation, sse, submit
from prefixserve.entrypoints.server.usage import usage_of
from prefixserve.entrypoints.server.prompting.bodies import ParsedChat, chat_body
from prefixserve.entrypoints.server.prompting.prompts import PreparedPrompt, prepare_prompt
from prefixserve.entrypoints.server.openai.tool_calls import ChatTools, ToolDeltas, finish_reason_of
from prefixserve.entrypoints.server.openai.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice,
                                                     ChatCompletionChunk, ChatCompletionRequest,
                                                     ChatCompletionResponse, ChatLogprobs,
                                                     DeltaMessage, TokenLogprob, TopLogprob)
from prefixserve.entrypoints.server.state import ServerState, get_state, new_id, principal, token_text
from prefixserve.entrypoints.server.prompting.pins import unix_time, warning_headers


async def create_chat_completion(parsed: Annotated[ParsedChat, Depends(chat_body("chat"))],
                                 request: Request) -> Response:
    body: ChatCompletionRequest = parsed.body  # without messages when it was large: see ParsedChat
    state = get_state(request)
    state.check_model(body.model)
    salt = state.namespace(request, body.cache_salt)
    priority = state.priority(request, body.priority)
    if body.logit_bias:
        raise bad_request("logit_bias is not supported", param="logit_bias", code="unsupported")
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    ask = diagnose_ask(body)
    tools = ChatTools.of(body, state.async_llm.tokenizer)
    prompt = await prepare_prompt(state, parsed.source, cached_content=body.cached_content, cache_salt=salt,
                                  tenant=principal(request).tenant,
                                  add_generation_prompt=body.add_generation_prompt,
                                  template_kwargs=_template_kwargs(body), with_spans=ask is not None)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    try:
        params = body.sampling_params(max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
        params = dataclasses.replace(params, structured=tools.structured)
    except InvalidRequestError as exc:
        raise api_error(exc, renames={"logprobs": "top_logprobs"}) from None
    live = LiveDiagnosis(state.explainer, ask, prompt.cache_salt,
                         prompt.rendered.spans)
    gen = await submit(state.async_llm, state.config, state.metrics, new_id("chatcmpl"),
                       [prompt.token_ids], params, cache_salt=prompt.cache_salt,
                       priority=priority, param="messages", cache_pins=prompt.plan.pins)
    created = int(time.time())
    if body.stream:
        return EventStream(_stream(state, gen, body, created, prompt, live, tools), on_close=gen.abort)
    (output,) = await gen.final_outputs(request)
    state.turns.remember(prompt.cache_salt, prompt.rendered.text, prompt.token_ids, output,
                         state.async_llm.tokenizer, prompt.tenant)
    choices = []
    for c in output.outputs:
        content, calls = tools.reply(c.text)
        choices.append(ChatChoice(index=c.index, message=AssistantMessage(content=content,
                                                                          tool_calls=calls or None),
                                  logprobs=_logprobs(state, c, 0),
                                  finish_reason=finish_reason_of(c.finish_reason, bool(calls)),
                                  stop_reason=c.stop_reason))
    response = ChatCompletionResponse(id=gen.request_ids[0], created=created,
                                      model=state.model_name, choices=choices,
                                      usage=usage_of([output]))
    body_json = response.model_dump()
    report = prompt.plan.report(output, unix_time(state.async_llm.now))
    extension = with_diagnosis(report, live.finish(gen.request_ids[0], output))
    if extension is not None:
        body_json["prefixserve"] = extension
    return JSONResponse(body_json, headers=warning_headers(prompt.plan.warnings(output)))


def _template_kwargs(body: ChatCompletionRequest) -> dict:
    # validation let a client template through only on a server that trusts them
    extra = {"chat_template": body.chat_template} if body.chat_template is not None else {}
    return {**(body.chat_template_kwargs or {}), **extra}


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
                  created: int, prompt: PreparedPrompt, live: LiveDiagnosis,
                  tools: ChatTools) -> AsyncIterator[str]:
    def chunk(choices: list[ChatChunkChoice]) -> str:
        return sse(ChatCompletionChunk(id=gen.request_ids[0], created=created,
                                       model=state.model_name, choices=choices))

    def extension(out: RequestOutput, diagnosis: Optional[dict]) -> Optional[dict]:
        return with_diagnosis(prompt.plan.report(out, unix_time(state.async_llm.now)),
                              diagnosis)

    yield chunk([ChatChunkChoice(index=k, delta=DeltaMessage(role="assistant", content=""))
                 for k in range(body.n)])
    deltas = {k: ToolDeltas(tools) for k in range(body.n)}
    sent_tokens: dict[int, int] = {}
    done: set[int] = set()
    last: Optional[RequestOutput] = None
    diagnosis: Optional[dict] = None
    try:
        async for _, out in gen.outputs():
            last = out
            choices = []
            for c in out.outputs:
                if c.index in done:
                    continue
                finished = c.finish_reason is not None
                delta = deltas[c.index].delta(c.text, finished)
                if not delta and not finished:
                    continue
                choices.append(ChatChunkChoice(
                    index=c.index, delta=DeltaMessage(**delta),
                    logprobs=_logprobs(state, c, sent_tokens.get(c.index, 0)),
                    finish_reason=finish_reason_of(c.finish_reason, deltas[c.index].called),
                    stop_reason=c.stop_reason))
                sent_tokens[c.index] = len(c.token_ids)
                if finished:
                    done.add(c.index)
            if out.finished:
                state.turns.remember(prompt.cache_salt, prompt.rendered.text, prompt.token_ids, out,
                                     state.async_llm.tokenizer, prompt.tenant)
                diagnosis = live.finish(gen.request_ids[0], out)
                if not body.include_usage_in_stream and diagnosis is not None:
                    # No usage chunk follows: the last content chunk carries the extension.
                    final = ChatCompletionChunk(id=gen.request_ids[0], created=created,
                                                model=state.model_name, choices=choices).model_dump()
                    final["prefixserve"] = extension(out, diagnosis)
                    yield f"data: {json.dumps(final)}\n\n"
                    continue
            if choices:
                yield chunk(choices)
    except APIError as exc:
        yield exc.sse()
        yield DONE_EVENT
        return
    if last is not None:
        prompt.plan.warnings(last)  # logged: a stream's headers left before the pins existed
    if body.include_usage_in_stream and last is not None:
        usage_chunk = ChatCompletionChunk(id=gen.request_ids[0], created=created,
                                          model=state.model_name, choices=[], usage=usage_of([last]))
        chunk_json = usage_chunk.model_dump()
        final_extension = extension(last, diagnosis)
        if final_extension is not None:
            chunk_json["prefixserve"] = final_extension
        yield f"data: {json.dumps(chunk_json)}\n\n"
    yield DONE_EVENT
