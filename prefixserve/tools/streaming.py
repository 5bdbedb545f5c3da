"""Incremental tool-call parsing for streams: fed the cumulative text, it says what is new as
content, which calls began (index, id, name) and which argument fragments followed.

A call begins once its header (`{"name": "...", "arguments": {`, see calls.py) is written: its
name goes out then and its arguments as they are written (arguments still open are sent up to
their last non-blank character; whatever follows can only extend them). Text that could still
become a call's start is held back: in the Qwen format a suffix that may grow into
`<tool_call>`, in the Llama 3 format the output's start while it may grow into a header (then it
is calls or, as soon as it cannot be one, content) and what follows a call while it may grow
into `; {"name": ...`. The fragments of a call always join into exactly the arguments
parse_tool_calls returns, a call the output ends inside included.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from prefixserve.tools.calls import (LLAMA_FIRST, LLAMA_NEXT, QWEN_HEADER, QWEN_OPEN, ToolCall,
                                     ToolFormat, call_extent, new_call_id, qwen_call_at)


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
        self._call_start = 0       # where the current call's body starts (qwen: after the tag)
        self._args_start: Optional[int] = None
        self._args_sent = 0        # characters of the current call's arguments sent
        self._content_only = False  # llama3: the rest of the output is content
        self._blank = ""           # blank content held back (see _content)

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
        """Events for the rest of the final text: held-back content, a call it ended inside."""
        if self.fmt == "llama3":
            return self._feed_llama(text, final=True)
        events = self.feed(text)
        if self._in_call:
            if self._args_start is None:  # no header: the unfinished tag and what follows stay text
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
            m = QWEN_HEADER.match(text, self._call_start)
            if m is not None:
                self._start(events, m.group("name"))
                self._args_start = m.end() - 1
        found = qwen_call_at(text, self._call_start)
        if found is None:
            if self._args_start is not None:
                self._args(events, call_extent(text, text.index("{", self._call_start),
                                               self._args_start)[0])
            return False
        call, end = found
        if self._args_start is None:
            self._start(events, call.name)
        self._args(events, call.arguments)
        self._in_call = False
        self._pos = end
        return True

    # -------------------------------------------------------------- llama3
    def _feed_llama(self, text: str, final: bool) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        while not self._content_only:
            if self._in_call:
                arguments, end = call_extent(text, self._call_start, self._args_start)
                self._args(events, arguments)
                if end is None:
                    return events
                self._in_call, self._pos = False, end
            m = (LLAMA_NEXT if self.calls else LLAMA_FIRST).match(text, self._pos, partial=True)
            if m is None or (m.partial and final):
                self._content_only = True
                break
            if m.partial:
                return events
            self._start(events, m.group("name"))
            self._in_call, self._call_start = True, m.start("open")
            self._args_start, self._args_sent = m.end() - 1, 0
        if self._pos < len(text):
            # what follows the calls: blank is no content, the rest goes out whole
            rest = text[self._pos:]
            if rest.strip() or not self.calls:
                events.append(ToolEvent("content", rest))
                self._pos = len(text)
        return events

    # -------------------------------------------------------------- shared
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
        # blank text after a call waits for text that says something (the finished content is
        # stripped): sent with it, it keeps the spacing between them
        if self.calls and not text.strip():
            self._blank += text
        elif text:
            events.append(ToolEvent("content", self._blank + text))
            self._blank = ""
