"""A streamed response: OpenAI's Responses events, written as the output grows (the tool-call
parser turns text into function-call items as it streams), ending on the finished response."""
from __future__ import annotations

import json
from typing import Any, Optional

from prefixserve.engine.outputs import RequestOutput
from prefixserve.entrypoints.server.errors import APIError
from prefixserve.entrypoints.server.pipeline import Finished
from prefixserve.entrypoints.server.responses.objects import call_item, message_item, text_part
from prefixserve.entrypoints.server.responses.turn import ResponseTurn
from prefixserve.entrypoints.server.streaming import ChoiceUpdate
from prefixserve.tools import ToolCallStream


class ResponseFraming:
    """OpenAI's Responses events: response.created and .in_progress; per output item
    output_item.added, its content part or argument deltas and their .done events, and
    output_item.done; then response.completed (or .incomplete) with the usage."""

    def __init__(self, turn: ResponseTurn) -> None:
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

    async def closing(self, last: list[RequestOutput], finished: Optional[Finished]) -> list[str]:
        (output,) = last
        completion = output.outputs[0]
        status = "incomplete" if completion.finish_reason == "length" else "completed"
        events = []
        if not self.items:
            events += self._add(message_item("", "in_progress"))
        events += self._close(status)
        response = await self.turn.finish(output, self.items)
        extension = self.turn.call.extension(last, finished.diagnoses if finished is not None else [None])
        if extension is not None:
            response["prefixserve"] = extension
        return events + [self._event(f"response.{status}", response=response)]
