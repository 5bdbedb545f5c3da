"""POST /v1/responses: items through the chat template, then generation, answered as a response
or streamed as OpenAI's Responses events; a stored response is kept (response_store.py) so that a
later request's previous_response_id continues it.

A continuation renders the stored items and the new input as one conversation. Its prompt starts
with exactly the tokens of the previous turn (its prompt and the tokens the model generated,
which the store keeps): they go back into the turn memory (prompting/turn_memory.py) before the
prompt renders, so even after a restart, or on another replica sharing the store, the prompt is
the previous one plus the new tokens, and every earlier turn is a cache hit.
"""
from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import JSONResponse, Response

from prefixserve.entrypoints.server.errors import APIError, bad_request
from prefixserve.entrypoints.server.pipeline import ChatPrompt, GenerationRequest, start
from prefixserve.entrypoints.server.prompting.bodies import json_body
from prefixserve.entrypoints.server.protocol import DiagnoseFields
from prefixserve.entrypoints.server.prompt_cache_fields import PromptCacheFields, request_cache_fields
from prefixserve.entrypoints.server.responses.events import ResponseFraming
from prefixserve.entrypoints.server.responses.items import (chat_tool_choice, chat_tools_of, conversation_of,
                                                            normalize_input, response_format_of)
from prefixserve.entrypoints.server.responses.objects import output_items, request_id_of
from prefixserve.entrypoints.server.responses.protocol import ResponsesRequest
from prefixserve.entrypoints.server.responses.store_reads import from_store
from prefixserve.entrypoints.server.responses.turn import ResponseTurn
from prefixserve.entrypoints.server.state import get_state, principal
from prefixserve.entrypoints.server.tools import ChatTools
from prefixserve.errors import InvalidRequestError
from prefixserve.prompt import Conversation
from prefixserve.sampling_params import SamplingParams


async def create_response(body: Annotated[ResponsesRequest, Depends(json_body(ResponsesRequest))],
                          request: Request) -> Response:
    state = get_state(request)
    tenant = principal(request).tenant
    cache = request_cache_fields(body)
    history: list[dict[str, Any]] = []
    previous = None
    if body.previous_response_id is not None:
        previous = await from_store(request, "read", state.responses.get, tenant, body.previous_response_id)
        if previous is None:
            raise APIError(404, f"no stored response {body.previous_response_id[:80]!r} to continue (unknown, "
                                f"expired, deleted or not stored)", type="not_found_error",
                           param="previous_response_id", code="previous_response_not_found")
        history = previous["history"]
    items = normalize_input(body.input, history)
    if len(history) + len(items) > state.config.max_messages:
        raise bad_request(f"{len(history)} stored and {len(items)} new items; this server takes at most "
                          f"{state.config.max_messages} per request", param="input", code="too_many_messages")
    tools = chat_tools_of(body.tools)
    conversation = conversation_of(body.instructions, history + items, tools, cache)
    if previous is not None and previous["turn"] is not None:
        state.turns.restore(state.namespace(request, body.cache_salt), previous["turn"]["text"],
                            previous["turn"]["ids"], tenant)
    try:
        call = await start(request, _generation_request(body, conversation, tools, cache))
    except (APIError, InvalidRequestError) as exc:
        if exc.param == "messages":  # the rendered conversation refused: here it is `input`
            exc.param = "input"
            if exc.message.startswith("messages "):
                exc.message = "input" + exc.message[len("messages"):]
        raise
    if call.raw_body is not None:
        call.raw_body = _loggable(body, conversation, tools)
    turn = ResponseTurn(call, body, history, items, tenant)
    if body.stream:
        return call.stream(ResponseFraming(turn))
    done = await call.collect(request)
    (output,) = done.outputs
    completion = output.outputs[0]
    response = await turn.finish(output, output_items(call.tools, completion.text, completion.finish_reason))
    extension = call.extension(done.outputs, done.diagnoses)
    if extension is not None:
        response["prefixserve"] = extension
    return JSONResponse(response, headers=call.warning_headers(output))


def _loggable(body: ResponsesRequest, conversation: Conversation, tools: list[dict[str, Any]]) -> bytes:
    """The request log's body: the chat-completions body this response's prompt renders from (a
    Responses body is not self-contained: its previous_response_id names a stored history), so
    `prefixserve lint` reads an agent loop over /v1/responses like one over chat completions."""
    chat: dict[str, Any] = {"model": body.model, "messages": [t.template_message() for t in conversation.turns]}
    if tools:
        chat["tools"] = tools
    return json.dumps(chat).encode()


def _generation_request(body: ResponsesRequest, conversation: Conversation,
                        tools: list[dict[str, Any]], cache: PromptCacheFields) -> GenerationRequest:
    def sampling(chat_tools: ChatTools) -> SamplingParams:
        return SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                              top_p=1.0 if body.top_p is None else body.top_p,
                              top_k=0 if body.top_k is None else body.top_k, seed=body.seed,
                              max_tokens=body.max_output_tokens, structured=chat_tools.structured)

    def build_tools(tokenizer) -> ChatTools:
        fmt = body.text.format if body.text is not None else None
        try:
            return ChatTools.build(tools or None, chat_tool_choice(body.tool_choice), body.parallel_tool_calls,
                                   response_format_of(fmt), tokenizer)
        except InvalidRequestError as exc:
            if exc.param is not None and exc.param.startswith("response_format"):
                param = "text.format" + exc.param[len("response_format"):].replace(".json_schema", "")
                raise InvalidRequestError(exc.message.replace("response_format", "text.format"),
                                          param=param) from None
            raise

    return GenerationRequest(
        id_prefix="resp", param="input", cache=cache, model=body.model, cache_salt=body.cache_salt,
        priority=body.priority, diagnose=_diagnose_fields(body), prompt=ChatPrompt(conversation, None),
        sampling=sampling, renames={"max_tokens": "max_output_tokens"}, tools=build_tools)


def _diagnose_fields(body: ResponsesRequest) -> DiagnoseFields:
    """The body's diagnosis fields, a response id in diagnose_against read as its request's id."""
    options = body.prefixserve
    if options is not None:
        options = options.model_copy(update={"diagnose_against": request_id_of(options.diagnose_against)})
    return DiagnoseFields(diagnose=body.diagnose, diagnose_against=request_id_of(body.diagnose_against),
                          prefixserve=options)
