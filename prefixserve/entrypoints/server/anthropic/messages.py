"""POST /v1/messages: the Anthropic Messages API subset a typical client uses.

System prompt (string or text blocks), text messages, tools (rendered into the prompt by the
chat template), max_tokens, temperature, top_p, top_k, stop_sequences and streaming with
Anthropic's event types. cache_control marks on blocks and tools are honoured as on the chat
endpoint, a top-level cache_control marks the last block (automatic caching), and usage reports
input_tokens / cache_creation_input_tokens / cache_read_input_tokens.
"""
from __future__ import annotations

from typing import Annotated, Any, AsyncIterator, Optional

from fastapi import Depends, Request
from fastapi.responses import JSONResponse, Response

from prefixserve.engine.outputs import CompletionOutput, RequestOutput
from prefixserve.entrypoints.server.anthropic.protocol import MessagesRequest
from prefixserve.entrypoints.server.anthropic.tool_stream import BlockStream
from prefixserve.entrypoints.server.anthropic.tools import message_tools, reply, stop_reason_of
from prefixserve.entrypoints.server.prompting.bodies import ParsedChat, chat_body
from prefixserve.entrypoints.server.diagnosis import (LiveDiagnosis, diagnose_ask,
                                                      with_diagnosis)
from prefixserve.entrypoints.server.errors import APIError, api_error
from prefixserve.errors import InvalidRequestError
from prefixserve.entrypoints.server.streaming import EventStream, Generation, named_event, submit
from prefixserve.entrypoints.server.prompting.prompts import PreparedPrompt, prepare_prompt
from prefixserve.entrypoints.server.state import ServerState, get_state, new_id, principal
from prefixserve.entrypoints.server.prompting.pins import unix_time, warning_headers
from prefixserve.entrypoints.server.usage import CacheUsage
from prefixserve.sampling_params import SamplingParams


async def create_message(parsed: Annotated[ParsedChat, Depends(chat_body("messages"))], request: Request) -> Response:
    body: MessagesRequest = parsed.body  # without messages and system when it was large: see ParsedChat
    state = get_state(request)
    state.check_model(body.model)
    salt = state.namespace(request, body.cache_salt)
    priority = state.priority(request, body.priority)
    ask = diagnose_ask(body)
    tools = message_tools(body, state.async_llm.tokenizer)
    prompt = await prepare_prompt(state, parsed.source, cached_content=body.cached_content,
                                  cache_salt=salt, tenant=principal(request).tenant,
                                  with_spans=ask is not None)
    try:
        params = SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k is None else body.top_k,
            max_tokens=body.max_tokens, stop=list(body.stop_sequences or []),
            structured=tools.structured)
    except InvalidRequestError as exc:
        raise api_error(exc, renames={"stop": "stop_sequences"}) from None
    live = LiveDiagnosis(state.explainer, ask, prompt.cache_salt,
                         prompt.rendered.spans)
    gen = await submit(state.async_llm, state.config, state.metrics, new_id("msg"),
                       [prompt.token_ids], params, cache_salt=prompt.cache_salt,
                       priority=priority, param="messages", cache_pins=prompt.plan.pins)
    if body.stream:
        first, rest = await gen.first_output(request)
        headers = warning_headers(prompt.plan.warnings(first))
        return EventStream(_events(state, gen, prompt, live, first, rest, BlockStream(tools.choice, tools.fmt)),
                           on_close=gen.abort, headers=headers)
    (output,) = await gen.final_outputs(request)
    state.turns.remember(prompt.cache_salt, prompt.rendered.text, prompt.token_ids, output,
                         state.async_llm.tokenizer, prompt.tenant)
    completion = output.outputs[0]
    stop_reason, stop_sequence = _stop(completion)
    message = _message(state, gen, prompt, output, live)
    content, called = reply(tools, completion.text)
    message.update(content=content, stop_reason=stop_reason_of(stop_reason, called),
                   stop_sequence=stop_sequence)
    return JSONResponse(message, headers=warning_headers(prompt.plan.warnings(output)))


def _message(state: ServerState, gen: Generation, prompt: PreparedPrompt, output: RequestOutput,
             live: Optional[LiveDiagnosis] = None) -> dict[str, Any]:
    """The message object; given `live` (the finished output), also remembers the request and
    adds its diagnosis when asked."""
    message: dict[str, Any] = {
        "id": gen.request_ids[0], "type": "message", "role": "assistant", "model": state.model_name,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": CacheUsage.of(output).anthropic(len(output.outputs[0].token_ids)),
    }
    report = prompt.plan.report(output, unix_time(state.async_llm.now))
    extension = with_diagnosis(report, live.finish(gen.request_ids[0], output)
                               if live is not None else None)
    if extension is not None:
        message["prefixserve"] = extension
    return message


def _stop(c: CompletionOutput) -> tuple[Optional[str], Optional[str]]:
    if c.finish_reason == "length":
        return "max_tokens", None
    if c.finish_reason == "stop":
        if isinstance(c.stop_reason, str):
            return "stop_sequence", c.stop_reason
        return "end_turn", None
    return None, None


async def _events(state: ServerState, gen: Generation, prompt: PreparedPrompt,
                  live: LiveDiagnosis, first: RequestOutput,
                  rest: AsyncIterator[tuple[int, RequestOutput]], blocks: BlockStream) -> AsyncIterator[str]:
    yield named_event("message_start", {"message": _message(state, gen, prompt, first)})
    for event in blocks.begin():
        yield event
    yield named_event("ping", {})
    last = first
    try:
        output: Optional[RequestOutput] = first
        while output is not None:
            last = output
            for event in blocks.feed(output.outputs[0].text, last.finished):
                yield event
            output = None if last.finished else (await anext(rest, (0, None)))[1]
    except APIError as exc:
        yield exc.anthropic_sse()
        return
    state.turns.remember(prompt.cache_salt, prompt.rendered.text, prompt.token_ids, last,
                         state.async_llm.tokenizer, prompt.tenant)
    completion = last.outputs[0]
    stop_reason, stop_sequence = _stop(completion)
    stop_reason = stop_reason_of(stop_reason, blocks.called)
    final = _message(state, gen, prompt, last, live)
    delta: dict[str, Any] = {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                             "usage": final["usage"]}
    if "prefixserve" in final:
        delta["prefixserve"] = final["prefixserve"]
    yield named_event("message_delta", delta)
    yield named_event("message_stop", {})
