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

import asyncio
import json
from typing import Annotated, Any, Optional

from fastapi import Depends, Request
from fastapi.responses import JSONResponse, Response

from prefixserve.engine.outputs import RequestOutput
from prefixserve.entrypoints.server.errors import APIError, bad_request
from prefixserve.entrypoints.server.pipeline import Call, ChatPrompt, Finished, GenerationRequest, start
from prefixserve.entrypoints.server.prompting.bodies import json_body
from prefixserve.entrypoints.server.prompting.turn_memory import turn_of
from prefixserve.entrypoints.server.responses.caching import check_cache_fields
from prefixserve.entrypoints.server.responses.items import (chat_tool_choice, chat_tools_of, conversation_of,
                                                            normalize_input, response_format_of)
from prefixserve.entrypoints.server.protocol import DiagnoseFields
from prefixserve.entrypoints.server.responses.objects import (call_item, message_item, output_items,
                                                              request_id_of, response_id, response_object,
                                                              text_part)
from prefixserve.entrypoints.server.responses.protocol import ResponsesRequest
from prefixserve.entrypoints.server.state import ServerState, get_state, principal
from prefixserve.entrypoints.server.streaming import ChoiceUpdate
from prefixserve.entrypoints.server.tools import ChatTools
from prefixserve.entrypoints.server.usage import TokenUsage
from prefixserve.errors import InvalidRequestError
from prefixserve.prompt import Conversation
from prefixserve.sampling_params import SamplingParams
from prefixserve.tools import ToolCallStream


async def create_response(body: Annotated[ResponsesRequest, Depends(json_body(ResponsesRequest))],
                          request: Request) -> Response:
    state = get_state(request)
    tenant = principal(request).tenant
    check_cache_fields(body)
    history: list[dict[str, Any]] = []
    previous = None
    if body.previous_response_id is not None:
        previous = await asyncio.to_thread(state.responses.get, tenant, body.previous_response_id)
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
    conversation = conversation_of(body.instructions, history + items, tools)
    if previous is not None and previous["turn"] is not None:
        state.turns.restore(state.namespace(request, body.cache_salt), previous["turn"]["text"],
                            previous["turn"]["ids"], tenant)
    try:
        call = await start(request, _generation_request(body, conversation, tools))
    except (APIError, InvalidRequestError) as exc:
        if exc.param == "messages":  # the rendered conversation refused: here it is `input`
            exc.param = "input"
            if exc.message.startswith("messages "):
                exc.message = "input" + exc.message[len("messages"):]
        raise
    if call.raw_body is not None:
        call.raw_body = _loggable(body, conversation, tools)
    turn = _Turn(call, body, history, items, tenant)
    if body.stream:
        return call.stream(_ResponseFraming(turn))
    done = await call.collect(request)
    (output,) = done.outputs
    completion = output.outputs[0]
    response = turn.finish(output, output_items(call.tools, completion.text, completion.finish_reason))
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
                        tools: list[dict[str, Any]]) -> GenerationRequest:
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
        id_prefix="resp", param="input", model=body.model, cache_salt=body.cache_salt,
        priority=body.priority, diagnose=_diagnose_fields(body), prompt=ChatPrompt(conversation, None),
        sampling=sampling, renames={"max_tokens": "max_output_tokens"}, tools=build_tools)


def _diagnose_fields(body: ResponsesRequest) -> DiagnoseFields:
    """The body's diagnosis fields, a response id in diagnose_against read as its request's id."""
    options = body.prefixserve
    if options is not None:
        options = options.model_copy(update={"diagnose_against": request_id_of(options.diagnose_against)})
    return DiagnoseFields(diagnose=body.diagnose, diagnose_against=request_id_of(body.diagnose_against),
                          prefixserve=options)


class _Turn:
    """One response being made: what it stores when it finishes."""

    def __init__(self, call: Call, body: ResponsesRequest, history: list[dict[str, Any]],
                 items: list[dict[str, Any]], tenant: Optional[str]) -> None:
        self.call, self.body, self.history, self.items, self.tenant = call, body, history, items, tenant
        self.id = response_id(call.id)
        self.created = float(call.created)

    @property
    def state(self) -> ServerState:
        return self.call.state

    def opened(self) -> dict[str, Any]:
        return response_object(self.id, self.body, self.state.model_name, self.created,
                               status="in_progress", output=[])

    def finish(self, output: RequestOutput, items: list[dict[str, Any]]) -> dict[str, Any]:
        """The finished response; stored (with the exact tokens of its turn) unless store is false."""
        completion = output.outputs[0]
        status = "incomplete" if completion.finish_reason == "length" else "completed"
        response = response_object(self.id, self.body, self.state.model_name, self.created, status=status,
                                   output=items, usage=TokenUsage.of([output]))
        if self.body.store:
            prompt = self.call.prompt
            turn = turn_of(prompt.rendered.text, prompt.token_ids, completion, self.state.async_llm.tokenizer)
            self.state.responses.put(self.tenant, {
                "id": self.id, "response": response, "history": self.history + self.items + items,
                "turn": {"text": turn[0], "ids": turn[1]} if turn is not None else None})
        return response


class _ResponseFraming:
    """OpenAI's Responses events: response.created and .in_progress; per output item
    output_item.added, its content part or argument deltas and their .done events, and
    output_item.done; then response.completed (or .incomplete) with the usage."""

    def __init__(self, turn: _Turn) -> None:
        self.turn = turn
        tools = turn.call.tools
        self.parse = tools.choice.parses_calls
        self.calls = ToolCallStream(tools.fmt)
        self.sent = 0
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self.open: Optional[int] = None          # index of the item being written
        self.call_items: dict[int, int] = {}     # a call's index -> its item's index

    def _event(self, kind: str, **data: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    def opening(self) -> list[str]:
        opened = self.turn.opened()
        return [self._event("response.created", response=opened),
                self._event("response.in_progress", response=opened)]

    def _add(self, item: dict[str, Any]) -> list[str]:
        events = self._close()
        self.items.append(item)
        self.open = len(self.items) - 1
        events.append(self._event("response.output_item.added", output_index=self.open, item=dict(item)))
        if item["type"] == "message":
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=self.open,
                                      content_index=0, part=text_part("")))
        return events

    def _close(self, status: str = "completed") -> list[str]:
        if self.open is None:
            return []
        index, item = self.open, self.items[self.open]
        self.open = None
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            events = [self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=part["text"], logprobs=[]),
                      self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=part)]
        else:
            events = [self._event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=index, name=item["name"], arguments=item["arguments"])]
        return events + [self._event("response.output_item.done", output_index=index, item=item)]

    def _text(self, fragment: str) -> list[str]:
        events = []
        if self.open is None or self.items[self.open]["type"] != "message":
            events += self._add(message_item("", "in_progress"))
        item = self.items[self.open]
        item["content"][0]["text"] += fragment
        return events + [self._event("response.output_text.delta", item_id=item["id"], output_index=self.open,
                                     content_index=0, delta=fragment, logprobs=[])]

    def choice(self, u: ChoiceUpdate) -> Optional[list[str]]:
        text = u.completion.text
        if not self.parse:
            fragment, self.sent = text[self.sent:], len(text)
            return self._text(fragment) if fragment else None
        events: list[str] = []
        for e in (self.calls.finish(text) if u.finished else self.calls.feed(text)):
            if e.kind == "content":
                events += self._text(e.text) if e.text else []
            elif e.kind == "start":
                events += self._add(call_item(e.id, e.name, "", "in_progress"))
                self.call_items[e.index] = self.open
            else:
                index = self.call_items[e.index]
                item = self.items[index]
                item["arguments"] += e.text
                events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                          output_index=index, delta=e.text))
        return events or None

    def chunk(self, pieces: list[list[str]], finished: Optional[Finished]) -> list[str]:
        return [event for piece in pieces for event in piece]

    def error(self, exc: APIError) -> list[str]:
        return [self._event("error", code=exc.code, message=exc.message, param=exc.param)]

    def closing(self, last: list[RequestOutput], finished: Optional[Finished]) -> list[str]:
        (output,) = last
        completion = output.outputs[0]
        status = "incomplete" if completion.finish_reason == "length" else "completed"
        events = []
        if not self.items:
            events += self._add(message_item("", "in_progress"))
        events += self._close(status)
        response = self.turn.finish(output, self.items)
        extension = self.turn.call.extension(last, finished.diagnoses if finished is not None else [None])
        if extension is not None:
            response["prefixserve"] = extension
        return events + [self._event(f"response.{status}", response=response)]
