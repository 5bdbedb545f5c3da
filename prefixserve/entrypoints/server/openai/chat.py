"""POST /v1/chat/completions: messages through the model's chat template, then generation. The
pipeline (pipeline.py) does the work; this module reads the body and writes OpenAI's objects."""
from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any, Optional

from fastapi import Depends, Request
from fastapi.responses import JSONResponse, Response

from prefixserve.engine.outputs import CompletionOutput, RequestOutput
from prefixserve.entrypoints.server.errors import APIError, bad_request
from prefixserve.entrypoints.server.openai.conversation import CHAT
from prefixserve.entrypoints.server.openai.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice,
                                                            ChatCompletionChunk, ChatCompletionRequest,
                                                            ChatCompletionResponse, ChatLogprobs,
                                                            DeltaMessage, TokenLogprob, TopLogprob, Usage)
from prefixserve.entrypoints.server.openai.tool_calls import ToolDeltas, chat_tools, finish_reason_of, reply
from prefixserve.entrypoints.server.pipeline import Call, ChatPrompt, Finished, GenerationRequest, start
from prefixserve.entrypoints.server.prompt_cache_fields import request_cache_fields
from prefixserve.entrypoints.server.prompting.bodies import ParsedChat, chat_body
from prefixserve.entrypoints.server.state import ServerState, token_text
from prefixserve.entrypoints.server.streaming import DONE_EVENT, ChoiceUpdate, sse
from prefixserve.entrypoints.server.usage import TokenUsage


async def create_chat_completion(parsed: Annotated[ParsedChat, Depends(chat_body(CHAT.name))],
                                 request: Request) -> Response:
    body: ChatCompletionRequest = parsed.body  # without messages when it was large: see ParsedChat
    call = await start(request, _generation_request(body, parsed))
    if body.stream:
        return call.stream(_ChatFraming(call, body))
    done = await call.collect(request)
    (output,) = done.outputs
    choices = []
    for c in output.outputs:
        content, calls = reply(call.tools, c.text)
        choices.append(ChatChoice(index=c.index, message=AssistantMessage(content=content,
                                                                          tool_calls=calls or None),
                                  logprobs=_logprobs(call.state, c, 0),
                                  finish_reason=finish_reason_of(c.finish_reason, bool(calls)),
                                  stop_reason=c.stop_reason))
    response = ChatCompletionResponse(id=call.id, created=call.created,
                                      model=call.state.model_name, choices=choices,
                                      usage=Usage.of(TokenUsage.of([output])))
    body_json = response.model_dump()
    extension = call.extension(done.outputs, done.diagnoses)
    if extension is not None:
        body_json["prefixserve"] = extension
    return JSONResponse(body_json, headers=call.warning_headers(output))


def _generation_request(body: ChatCompletionRequest, parsed: ParsedChat) -> GenerationRequest:
    def check() -> None:
        if body.logit_bias:
            raise bad_request("logit_bias is not supported", param="logit_bias", code="unsupported")
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")

    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens

    def sampling(tools) -> Any:
        params = body.sampling_params(max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
        return dataclasses.replace(params, structured=tools.structured)

    # checked here too, so a bad value is refused before anything renders
    cache = request_cache_fields(body)
    return GenerationRequest(
        id_prefix="chatcmpl", cache=cache, param="messages", model=body.model, cache_salt=body.cache_salt,
        priority=body.priority, diagnose=body,
        prompt=ChatPrompt(parsed.source, body.cached_content, body.add_generation_prompt,
                          _template_kwargs(body)),
        sampling=sampling, check=check,
        renames={"logprobs": "top_logprobs",
                 **({"max_tokens": "max_completion_tokens"} if body.max_completion_tokens is not None else {})},
        tools=lambda tokenizer: chat_tools(body, tokenizer))


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


class _ChatFraming:
    """Chat chunks: the assistant role first, content and tool-call deltas per choice, the
    `prefixserve` object on the last chunk (the usage chunk when one is asked for), [DONE]."""

    def __init__(self, call: Call, body: ChatCompletionRequest) -> None:
        self.call, self.body = call, body
        self.deltas = {k: ToolDeltas(call.tools) for k in range(body.n)}

    def _chunk(self, choices: list[ChatChunkChoice], usage: Optional[Usage] = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.call.id, created=self.call.created,
                                   model=self.call.state.model_name, choices=choices, usage=usage)

    def opening(self) -> list[str]:
        return [sse(self._chunk([ChatChunkChoice(index=k, delta=DeltaMessage(role="assistant", content=""))
                                 for k in range(self.body.n)]))]

    def choice(self, u: ChoiceUpdate) -> Optional[ChatChunkChoice]:
        c = u.completion
        delta = self.deltas[u.index].delta(c.text, u.finished)
        if not delta and not u.finished:
            return None
        return ChatChunkChoice(index=u.index, delta=DeltaMessage(**delta),
                               logprobs=_logprobs(self.call.state, c, u.token_start),
                               finish_reason=finish_reason_of(c.finish_reason, self.deltas[u.index].called),
                               stop_reason=c.stop_reason)

    def chunk(self, choices: list[ChatChunkChoice], finished: Optional[Finished]) -> list[str]:
        if finished is not None and not self.body.include_usage_in_stream and finished.diagnoses[0] is not None:
            # No usage chunk follows: the last content chunk carries the extension.
            final = self._chunk(choices).model_dump()
            final["prefixserve"] = self.call.extension(finished.outputs, finished.diagnoses)
            return [f"data: {json.dumps(final)}\n\n"]
        return [sse(self._chunk(choices))] if choices else []

    def error(self, exc: APIError) -> list[str]:
        return [exc.sse(), DONE_EVENT]

    async def closing(self, last: list[RequestOutput], finished: Optional[Finished]) -> list[str]:
        events = []
        if last:
            self.call.warning_headers(last[0])  # logged: a stream's headers left before the pins existed
        if self.body.include_usage_in_stream and last:
            chunk_json = self._chunk([], Usage.of(TokenUsage.of(last))).model_dump()
            extension = self.call.extension(last, finished.diagnoses if finished is not None else [None])
            if extension is not None:
                chunk_json["prefixserve"] = extension
            events.append(f"data: {json.dumps(chunk_json)}\n\n")
        return events + [DONE_EVENT]
