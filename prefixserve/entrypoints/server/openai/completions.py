"""POST /v1/completions (with chat's response_format: JSON or a JSON schema, as vLLM takes it)."""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Annotated, Any, AsyncIterator, Optional, Union

from fastapi import Depends, Request
from fastapi.responses import JSONResponse, Response

from prefixserve.engine.outputs import CompletionOutput, RequestOutput
from prefixserve.entrypoints.server.diagnosis import LiveDiagnosis, diagnose_ask
from prefixserve.entrypoints.server.errors import APIError, api_error, bad_request
from prefixserve.errors import InvalidRequestError
from prefixserve.entrypoints.server.streaming import DONE_EVENT, EventStream, Generation, sse, submit
from prefixserve.entrypoints.server.usage import usage_of
from prefixserve.entrypoints.server.prompting.bodies import json_body
from prefixserve.entrypoints.server.openai.tool_calls import response_format_of
from prefixserve.entrypoints.server.openai.protocol import (CompletionChoice, CompletionLogprobs,
                                                     CompletionRequest, CompletionResponse)
from prefixserve.entrypoints.server.state import ServerState, get_state, new_id, token_text


async def create_completion(body: Annotated[CompletionRequest, Depends(json_body(CompletionRequest))],
                            request: Request) -> Response:
    state = get_state(request)
    state.check_model(body.model)
    salt = state.namespace(request, body.cache_salt)
    priority = state.priority(request, body.priority)
    _reject_unsupported(body)
    live = LiveDiagnosis(state.explainer, diagnose_ask(body), salt)
    prompts = await _prompt_token_ids(state, body.prompt)
    max_tokens = body.max_tokens if body.max_tokens is not None \
        else state.config.default_completion_max_tokens
    try:
        params = dataclasses.replace(body.sampling_params(max_tokens, body.logprobs),
                                     structured=response_format_of(body.response_format))
    except InvalidRequestError as exc:
        raise api_error(exc) from None
    gen = await submit(state.async_llm, state.config, state.metrics, new_id("cmpl"), prompts, params,
                       cache_salt=salt, priority=priority, param="prompt")
    created = int(time.time())
    if body.stream:
        return EventStream(_stream(state, gen, body, created, live), on_close=gen.abort)
    outputs = await gen.final_outputs(request)
    choices = [_choice(state, i * params.n + c.index, c, c.text, 0, 0)
               for i, out in enumerate(outputs) for c in out.outputs]
    response = CompletionResponse(id=gen.request_ids[0], created=created, model=state.model_name,
                                  choices=choices, usage=usage_of(outputs))
    body_json = response.model_dump()
    extension = _extension(live, gen, outputs)
    if extension is not None:
        body_json["prefixserve"] = extension
    return JSONResponse(body_json)


def _extension(live: LiveDiagnosis, gen: Generation,
               outputs: list[RequestOutput]) -> Optional[dict[str, Any]]:
    """Remembers every prompt (under its engine request id: the response id, or
    `<response base id>-<i>` for several prompts); the `prefixserve` object when diagnosis was
    asked: {"diagnosis": {...}}, or a list of them, each with its request_id, for several prompts."""
    diagnoses = [live.finish(rid, out) for rid, out in zip(gen.request_ids, outputs)]
    if live.ask is None:
        return None
    if len(diagnoses) == 1:
        return {"diagnosis": diagnoses[0]}
    return {"diagnosis": [{"request_id": rid, **d} for rid, d in zip(gen.request_ids, diagnoses)]}


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


async def _prompt_token_ids(state: ServerState, prompt: Union[str, list]) -> list[list[int]]:
    """Every accepted prompt form as a list of token-id prompts; token ids are checked by the engine."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    if not prompt or any(not p for p in prompt):
        raise bad_request("prompt is empty", param="prompt", code="empty_prompt")
    texts = [p for p in prompt if isinstance(p, str)]
    encoded = iter(await state.renderer.encode(texts, add_special_tokens=True) if texts else [])
    return [next(encoded) if isinstance(p, str) else list(p) for p in prompt]


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


async def _stream(state: ServerState, gen: Generation, body: CompletionRequest,
                  created: int, live: LiveDiagnosis) -> AsyncIterator[str]:
    n = body.n
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    sent_finish: set[int] = set()
    offsets: dict[int, int] = {}
    last: dict[int, RequestOutput] = {}
    extension: Optional[dict[str, Any]] = None
    try:
        async for i, out in gen.outputs():
            last[i] = out
            choices = []
            for c in out.outputs:
                index = i * n + c.index
                if index in sent_finish:
                    continue
                delta = c.text[sent_text.get(index, 0):]
                finished = c.finish_reason is not None
                if not delta and not finished:
                    continue
                choice = _choice(state, index, c, delta, sent_tokens.get(index, 0),
                                 offsets.get(index, 0), finished)
                if choice.logprobs is not None and choice.logprobs.tokens:
                    offsets[index] = choice.logprobs.text_offset[-1] + len(choice.logprobs.tokens[-1])
                sent_text[index] = len(c.text)
                sent_tokens[index] = len(c.token_ids)
                if finished:
                    sent_finish.add(index)
                choices.append(choice)
            if len(last) == len(gen.request_ids) and all(o.finished for o in last.values()):
                # Every prompt is done: nothing follows this chunk but the usage chunk.
                extension = _extension(live, gen, [last[k] for k in sorted(last)])
                if extension is not None and not body.include_usage_in_stream:
                    final = CompletionResponse(id=gen.request_ids[0], created=created,
                                               model=state.model_name, choices=choices).model_dump()
                    yield f"data: {json.dumps({**final, 'prefixserve': extension})}\n\n"
                    continue
            if choices:
                yield sse(CompletionResponse(id=gen.request_ids[0], created=created,
                                             model=state.model_name, choices=choices))
    except APIError as exc:
        yield exc.sse()
        yield DONE_EVENT
        return
    if body.include_usage_in_stream:
        outputs = [last[i] for i in sorted(last)]
        usage = CompletionResponse(id=gen.request_ids[0], created=created, model=state.model_name,
                                   choices=[], usage=usage_of(outputs))
        if extension is None:
            yield sse(usage)
        else:
            yield f"data: {json.dumps({**usage.model_dump(), 'prefixserve': extension})}\n\n"
    yield DONE_EVENT


