"""POST /v1/completions (with chat's response_format: JSON or a JSON schema, as vLLM takes it).
The pipeline (pipeline.py) does the work; this module reads the body and writes OpenAI's
objects."""
from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any, Optional

from fastapi import Depends, Request
from fastapi.responses import JSONResponse, Response

from prefixserve.engine.outputs import CompletionOutput, RequestOutput
from prefixserve.entrypoints.server.errors import APIError, bad_request
from prefixserve.entrypoints.server.openai.protocol import (CompletionChoice, CompletionLogprobs,
                                                            CompletionRequest, CompletionResponse, Usage)
from prefixserve.entrypoints.server.pipeline import Call, Finished, GenerationRequest, TextPrompts, start
from prefixserve.entrypoints.server.prompt_cache_fields import request_cache_fields
from prefixserve.entrypoints.server.prompting.bodies import json_body
from prefixserve.entrypoints.server.state import ServerState, get_state, token_text
from prefixserve.entrypoints.server.streaming import DONE_EVENT, ChoiceUpdate, sse
from prefixserve.entrypoints.server.tools import response_format_of
from prefixserve.entrypoints.server.usage import TokenUsage


async def create_completion(body: Annotated[CompletionRequest, Depends(json_body(CompletionRequest))],
                            request: Request) -> Response:
    call = await start(request, _generation_request(request, body))
    if body.stream:
        return call.stream(_CompletionFraming(call, body))
    done = await call.collect(request)
    choices = [_choice(call.state, i * body.n + c.index, c, c.text, 0, 0)
               for i, out in enumerate(done.outputs) for c in out.outputs]
    response = CompletionResponse(id=call.id, created=call.created, model=call.state.model_name,
                                  choices=choices, usage=Usage.of(TokenUsage.of(done.outputs)))
    body_json = response.model_dump()
    extension = call.extension(done.outputs, done.diagnoses)
    if extension is not None:
        body_json["prefixserve"] = extension
    return JSONResponse(body_json)


def _generation_request(request: Request, body: CompletionRequest) -> GenerationRequest:
    max_tokens = body.max_tokens if body.max_tokens is not None \
        else get_state(request).config.default_completion_max_tokens

    def sampling(tools) -> Any:
        return dataclasses.replace(body.sampling_params(max_tokens, body.logprobs),
                                   structured=response_format_of(body.response_format))

    cache = request_cache_fields(body)
    return GenerationRequest(
        id_prefix="cmpl", param="prompt", cache=cache, model=body.model, cache_salt=body.cache_salt,
        priority=body.priority, diagnose=body, prompt=TextPrompts(body.prompt), sampling=sampling,
        check=lambda: _reject_unsupported(body))


def _reject_unsupported(body: CompletionRequest) -> None:
    if body.echo:
        raise bad_request("echo is not supported", param="echo", code="unsupported")
    if body.suffix:
        raise bad_request("suffix is not supported", param="suffix", code="unsupported")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of other than n is not supported", param="best_of",
                          code="unsupported")
    if body.logit_bias:
        raise bad_request("logit_bias is not supported", param="logit_bias", code="unsupported")


def _choice(state: ServerState, index: int, c: CompletionOutput, text: str, token_start: int,
            text_offset: int, finished: bool = True) -> CompletionChoice:
    logprobs = None
    if c.logprobs is not None:
        logprobs = _logprobs(state, c, token_start, text_offset)
    return CompletionChoice(index=index, text=text, logprobs=logprobs,
                            finish_reason=c.finish_reason if finished else None,
                            stop_reason=c.stop_reason if finished else None)


def _logprobs(state: ServerState, c: CompletionOutput, start: int,
              text_offset: int) -> CompletionLogprobs:
    tokenizer = state.async_llm.tokenizer
    result = CompletionLogprobs()
    offset = text_offset
    for token_id, (logprob, top) in zip(c.token_ids[start:], c.logprobs[start:]):
        text = token_text(tokenizer, token_id)
        result.tokens.append(text)
        result.token_logprobs.append(logprob)
        alternatives = {token_text(tokenizer, t): lp for t, lp in top}
        alternatives.setdefault(text, logprob)
        result.top_logprobs.append(alternatives)
        result.text_offset.append(offset)
        offset += len(text)
    return result


class _CompletionFraming:
    """Completion chunks: text deltas per choice (prompt i's sample k is choice i * n + k), the
    `prefixserve` object on the last chunk (the usage chunk when one is asked for), [DONE]."""

    def __init__(self, call: Call, body: CompletionRequest) -> None:
        self.call, self.body = call, body
        self.offsets: dict[int, int] = {}   # each choice's logprobs text_offset so far
        self.extension: Optional[dict[str, Any]] = None

    def _response(self, choices: list[CompletionChoice], usage: Optional[Usage] = None) -> CompletionResponse:
        return CompletionResponse(id=self.call.id, created=self.call.created,
                                  model=self.call.state.model_name, choices=choices, usage=usage)

    def opening(self) -> list[str]:
        return []

    def choice(self, u: ChoiceUpdate) -> Optional[CompletionChoice]:
        c = u.completion
        delta = c.text[u.text_start:]
        if not delta and not u.finished:
            return None
        choice = _choice(self.call.state, u.index, c, delta, u.token_start, self.offsets.get(u.index, 0),
                         u.finished)
        if choice.logprobs is not None and choice.logprobs.tokens:
            self.offsets[u.index] = choice.logprobs.text_offset[-1] + len(choice.logprobs.tokens[-1])
        return choice

    def chunk(self, choices: list[CompletionChoice], finished: Optional[Finished]) -> list[str]:
        if finished is not None:
            # Every prompt is done: nothing follows this chunk but the usage chunk.
            self.extension = self.call.extension(finished.outputs, finished.diagnoses)
            if self.extension is not None and not self.body.include_usage_in_stream:
                final = self._response(choices).model_dump()
                return [f"data: {json.dumps({**final, 'prefixserve': self.extension})}\n\n"]
        return [sse(self._response(choices))] if choices else []

    def error(self, exc: APIError) -> list[str]:
        return [exc.sse(), DONE_EVENT]

    async def closing(self, last: list[RequestOutput], finished: Optional[Finished]) -> list[str]:
        events = []
        if self.body.include_usage_in_stream:
            usage = self._response([], Usage.of(TokenUsage.of(last)))
            if self.extension is None:
                events.append(sse(usage))
            else:
                events.append(f"data: {json.dumps({**usage.model_dump(), 'prefixserve': self.extension})}\n\n")
        return events + [DONE_EVENT]
