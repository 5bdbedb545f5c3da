"""The one stream loop of every generation endpoint, and server-sent events.

`relay` follows a request's outputs and works out, per choice, what is new since the last event
(text and tokens), skipping choices already finished; it says when every prompt has finished
(then the pipeline remembers the request), and turns an engine error into the dialect's error
event. A dialect only frames: its `Framing` says what a choice's update becomes and how the
opening, each chunk, an error and the closing are written (OpenAI's data lines ending in
[DONE], Anthropic's named events). The closing is awaited: it may do I/O first (a Responses
stream stores its response before its last event)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional, Protocol

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from prefixserve.engine.outputs import CompletionOutput, RequestOutput
from prefixserve.entrypoints.server.errors import APIError

DONE_EVENT = "data: [DONE]\n\n"


@dataclass(frozen=True)
class ChoiceUpdate:
    """One choice's newest cumulative output, and how much of it earlier events sent."""
    index: int              # in the response: sample k of prompt i is choice i * n + k
    output: RequestOutput
    completion: CompletionOutput
    text_start: int         # characters of completion.text already sent
    token_start: int        # tokens of completion.token_ids already sent
    finished: bool


class Framing(Protocol):
    """How one dialect writes a stream. `choice` returns None while there is nothing to send for
    the choice (the loop then counts nothing of it as sent); `finished`, given to `chunk` once,
    is what the pipeline's finish returned when every prompt had finished."""
    def opening(self) -> list[str]: ...
    def choice(self, update: ChoiceUpdate) -> Any: ...
    def chunk(self, pieces: list[Any], finished: Any) -> list[str]: ...
    def error(self, exc: APIError) -> list[str]: ...
    async def closing(self, last: list[RequestOutput], finished: Any) -> list[str]: ...


async def relay(outputs: AsyncIterator[tuple[int, RequestOutput]], prompts: int, samples_per_prompt: int,
                framing: Framing, finish: Callable[[list[RequestOutput]], Any]) -> AsyncIterator[str]:
    """The events of one streamed response. `finish` runs once, with every prompt's final output."""
    for event in framing.opening():
        yield event
    sent: dict[int, tuple[int, int]] = {}   # choice -> (characters, tokens) sent
    done: set[int] = set()
    last: dict[int, RequestOutput] = {}
    finished: Optional[Any] = None
    try:
        async for i, out in outputs:
            last[i] = out
            pieces = []
            for c in out.outputs:
                index = i * samples_per_prompt + c.index
                if index in done:
                    continue
                text_start, token_start = sent.get(index, (0, 0))
                update = ChoiceUpdate(index, out, c, text_start, token_start, c.finish_reason is not None)
                piece = framing.choice(update)
                if piece is None:
                    continue
                sent[index] = (len(c.text), len(c.token_ids))
                if update.finished:
                    done.add(index)
                pieces.append(piece)
            now_finished = None
            if finished is None and len(last) == prompts and all(o.finished for o in last.values()):
                finished = now_finished = finish([last[k] for k in sorted(last)])
            for event in framing.chunk(pieces, now_finished):
                yield event
    except APIError as exc:
        for event in framing.error(exc):
            yield event
        return
    for event in await framing.closing([last[k] for k in sorted(last)], finished):
        yield event


def sse(model: BaseModel) -> str:
    """One OpenAI-style event: a data line holding the JSON body."""
    return f"data: {model.model_dump_json()}\n\n"


def named_event(kind: str, data: dict[str, Any]) -> str:
    """One Anthropic-style event: its kind named on an event line and again in the body's type."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


class EventStream(StreamingResponse):
    """Server-sent events whose generation is aborted however the response ends.

    Starlette cancels the body when the client disconnects; on_close runs in
    every case, so the engine frees the request's blocks before its next step.
    """

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None],
                 headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                  **(headers or {})})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
