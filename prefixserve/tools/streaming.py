"""Incremental tool-call parsing for streams: fed the cumulative text, it says what is new as
content, which calls began (index, id, name) and which argument fragments followed.

Qwen-format calls stream their arguments as they are written: text that could still be the
start of `<tool_call>` is held back, and inside a call so is everything from its last `}` on
(that brace may close the call's outer object rather than the arguments). Llama 3 calls are one
JSON document, known to be a call only once it parses: they come out whole at the end.
The fragments of a call always join into exactly the arguments parse_tool_calls returns.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, Optional

from prefixserve.tools.calls import (LLAMA_TAG, QWEN_CLOSE, QWEN_OPEN, ToolCall, ToolFormat,
                                     new_call_id, parse_tool_calls, qwen_call_at)

_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*(?=\S)')


@dataclass
class ToolEvent:
    kind: Literal["content", "start", "args"]
    text: str = ""            # content or argument fragment
    index: int = 0            # the call's index ("start", "args")
    name: str = ""            # "start"
    id: str = ""              # "start"


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCallStream:
    def __init__(self, fmt: ToolFormat, id_prefix: str = "call_") -> None:
        self.fmt = fmt
        self.id_prefix = id_prefix
        self.calls: list[ToolCall] = []
        self._pos = 0              # text consumed
        self._in_call = False
        self._call_start = 0       # where the current call's body starts
        self._args_start: Optional[int] = None
        self._args_sent = 0        # characters of the current call's arguments sent
        self._llama: Optional[bool] = None  # llama3: is the output a call? (None: not known yet)

    def feed(self, text: str) -> list[ToolEvent]:
        """Events for what `text` (the whole output so far) adds."""
        if self.fmt == "llama3":
            return self._feed_llama(text, final=False)
        events: list[ToolEvent] = []
        while True:
            if not self._in_call:
                at = text.find(QWEN_OPEN, self._pos)
                if at < 0:
                    safe = len(text) - _held_prefix(text[self._pos:], QWEN_OPEN)
                    self._content(events, text[self._pos:safe])
                    self._pos = safe
                    return events
                self._content(events, text[self._pos:at])
                self._in_call, self._call_start = True, at + len(QWEN_OPEN)
                self._args_start, self._args_sent = None, 0
                self._pos = self._call_start
            if not self._step_call(text, events):
                return events

    def finish(self, text: str) -> list[ToolEvent]:
        """Events for the rest of the final text: held-back content, an unterminated call."""
        if self.fmt == "llama3":
            return self._feed_llama(text, final=True)
        events = self.feed(text)
        if self._in_call:
            if self._args_start is not None:
                self._args(events, text[self._args_start:])
            else:
                self._content(events, text[self._call_start - len(QWEN_OPEN):])
            self._in_call = False
        else:
            self._content(events, text[self._pos:])
        self._pos = len(text)
        return events

    # ---------------------------------------------------------------- qwen
    def _step_call(self, text: str, events: list[ToolEvent]) -> bool:
        """Advances inside a call; True when the call closed (parsing goes on after it)."""
        if self._args_start is None:
            m = _HEADER.match(text, self._call_start)
            if m is not None:
                self._start(events, m.group(1))
                self._args_start = m.end()
        found = qwen_call_at(text, self._call_start)
        if found is None:
            if self._args_start is not None:
                tail = text[self._args_start:]
                self._args(events, tail[:max(tail.rfind("}"), 0)])
            return False
        call, end = found
        close = end - len(QWEN_CLOSE)
        if self._args_start is not None:
            rest = text[self._args_start:close].rstrip()
            self._args(events, rest[:-1].rstrip() if rest.endswith("}") else rest)
        else:
            self._start(events, call.name)
            self._args(events, call.arguments)
        self._in_call = False
        self._pos = end
        return True

    def _start(self, events: list[ToolEvent], name: str) -> None:
        call = ToolCall(name, "", new_call_id(self.id_prefix))
        self.calls.append(call)
        events.append(ToolEvent("start", index=len(self.calls) - 1, name=name, id=call.id))

    def _args(self, events: list[ToolEvent], args_so_far: str) -> None:
        if len(args_so_far) > self._args_sent:
            fragment = args_so_far[self._args_sent:]
            self._args_sent = len(args_so_far)
            self.calls[-1].arguments += fragment
            events.append(ToolEvent("args", fragment, index=len(self.calls) - 1))

    def _content(self, events: list[ToolEvent], text: str) -> None:
        # between and after calls only text that says something is content
        if text and (not self.calls or text.strip()):
            events.append(ToolEvent("content", text))

    # -------------------------------------------------------------- llama3
    def _feed_llama(self, text: str, final: bool) -> list[ToolEvent]:
        body = text.lstrip()
        if self._llama is None and body:
            could_be = body.startswith("{") or LLAMA_TAG.startswith(body[:len(LLAMA_TAG)])
            self._llama = None if could_be else False
        events: list[ToolEvent] = []
        if self._llama is False:
            self._content(events, text[self._pos:])
            self._pos = len(text)
            return events
        if not final:
            return events
        content, calls = parse_tool_calls(text, "llama3")
        if not calls:
            self._content(events, text[self._pos:])
        for call in calls:
            self._start(events, call.name)
            self._args_sent = 0
            self._args(events, call.arguments)
        self._pos = len(text)
        return events
