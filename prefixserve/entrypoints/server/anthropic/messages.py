"""POST /v1/messages: the Anthropic Messages API subset a typical client uses.

System prompt (string or text blocks), text messages, tools (rendered into the prompt by the
chat template), max_tokens, temperature, top_p, top_k, stop_sequences and streaming with
Anthropic's event types. cache_control marks on blocks and tools are honoured as on the chat
endpoint, a top-level cache_control marks the last block (automatic caching), and usage reports
input_tokens / cache_creation_input_tokens / cache_read_input_tokens. The pipeline
(pipeline.py) does the work; this module reads the body and writes Anthropic's objects.
"""
from __future__ import annotations

from typing import Annotated, Any, Optional

from fastapi import Depends, Request
from fastapi.responses import JSONResponse, Response

from prefixserve.engine.outputs import CompletionOutput, RequestOutput
from prefixserve.entrypoints.server.anthropic.conversation import MESSAGES
from prefixserve.entrypoints.server.anthropic.protocol import MessagesRequest
from prefixserve.entrypoints.server.anthropic.tool_stream import BlockStream
from prefixserve.entrypoints.server.anthropic.tools import message_tools, reply, stop_reason_of
from prefixserve.entrypoints.server.errors import APIError
from prefixserve.entrypoints.server.pipeline import Call, ChatPrompt, Finished, GenerationRequest, start
from prefixserve.entrypoints.server.prompting.bodies import ParsedChat, chat_body
from prefixserve.entrypoints.server.streaming import ChoiceUpdate, named_event
from prefixserve.entrypoints.server.usage import TokenUsage
from prefixserve.sampling_params import SamplingParams


async def create_message(parsed: Annotated[ParsedChat, Depends(chat_body(MESSAGES.name))],
                         request: Request) -> Response:
    body: MessagesRequest = parsed.body  # without messages and system when it was large: see ParsedChat
    call = await start(request, _generation_request(body, parsed))
    if body.stream:
        first, outputs = await call.first_output(request)
        headers = call.warning_headers(first)
        return call.stream(_MessageFraming(call, first), outputs, headers=headers)
    done = await call.collect(request)
    (output,) = done.outputs
    completion = output.outputs[0]
    stop_reason, stop_sequence = _stop(completion)
    message = _message(call, output, done.diagnoses[0])
    content, called = reply(call.tools, completion.text)
    message.update(content=content, stop_reason=stop_reason_of(stop_reason, called),
                   stop_sequence=stop_sequence)
    return JSONResponse(message, headers=call.warning_headers(output))


def _generation_request(body: MessagesRequest, parsed: ParsedChat) -> GenerationRequest:
    def sampling(tools) -> SamplingParams:
        return SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k is None else body.top_k,
            max_tokens=body.max_tokens, stop=list(body.stop_sequences or []),
            structured=tools.structured)

    return GenerationRequest(
        id_prefix="msg", param="messages", model=body.model, cache_salt=body.cache_salt,
        priority=body.priority, diagnose=body, prompt=ChatPrompt(parsed.source, body.cached_content),
        sampling=sampling, renames={"stop": "stop_sequences"},
        tools=lambda tokenizer: message_tools(body, tokenizer))


def _message(call: Call, output: RequestOutput, diagnosis: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The message object, with its diagnosis when one was asked for."""
    usage = TokenUsage.of([output])
    message: dict[str, Any] = {
        "id": call.id, "type": "message", "role": "assistant", "model": call.state.model_name,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": usage.uncached, "output_tokens": usage.completion_tokens,
                  "cache_creation_input_tokens": usage.written, "cache_read_input_tokens": usage.read},
    }
    extension = call.extension([output], [diagnosis])
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


class _MessageFraming:
    """Anthropic's events: message_start (from the first output), content blocks (tool_stream.py),
    a ping, then message_delta with the stop reason and usage, and message_stop."""

    def __init__(self, call: Call, first: RequestOutput) -> None:
        self.call, self.first = call, first
        self.blocks = BlockStream(call.tools.choice, call.tools.fmt)

    def opening(self) -> list[str]:
        return [named_event("message_start", {"message": _message(self.call, self.first)}),
                *self.blocks.begin(), named_event("ping", {})]

    def choice(self, u: ChoiceUpdate) -> list[str]:
        return self.blocks.feed(u.completion.text, u.output.finished)

    def chunk(self, events: list[list[str]], finished: Optional[Finished]) -> list[str]:
        return [event for piece in events for event in piece]

    def error(self, exc: APIError) -> list[str]:
        return [exc.anthropic_sse()]

    async def closing(self, last: list[RequestOutput], finished: Optional[Finished]) -> list[str]:
        (output,) = last
        stop_reason, stop_sequence = _stop(output.outputs[0])
        stop_reason = stop_reason_of(stop_reason, self.blocks.called)
        final = _message(self.call, output, finished.diagnoses[0] if finished is not None else None)
        delta: dict[str, Any] = {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                 "usage": final["usage"]}
        if "prefixserve" in final:
            delta["prefixserve"] = final["prefixserve"]
        return [named_event("message_delta", delta), named_event("message_stop", {})]
