"""A Messages stream's content blocks: text deltas and, when the request offers tools, tool_use
blocks whose input arrives as input_json_delta fragments (Anthropic's streaming format).

Without tools the text block opens at once, as before. With tools a block opens when its first
piece is known: a call closes the text block before it, and a stream that wrote nothing still
gets one (empty) text block, so every message has content."""
from __future__ import annotations

from typing import Any, Optional

from prefixserve.entrypoints.server.streaming import named_event
from prefixserve.tools import ToolCallStream, ToolFormat
from prefixserve.tools.choice import ToolChoice


class BlockStream:
    def __init__(self, choice: ToolChoice, fmt: ToolFormat) -> None:
        self.parser = ToolCallStream(fmt, id_prefix="toolu_") if choice.parses_calls else None
        self.index = -1
        self.open_kind: Optional[str] = None
        self.sent = 0

    @property
    def called(self) -> bool:
        return self.parser is not None and bool(self.parser.calls)

    def begin(self) -> list[str]:
        return [] if self.parser is not None else self._open({"type": "text", "text": ""})

    def feed(self, text: str, final: bool) -> list[str]:
        if self.parser is None:
            fragment, self.sent = text[self.sent:], len(text)
            out = [self._delta({"type": "text_delta", "text": fragment})] if fragment else []
        else:
            out = []
            for e in (self.parser.finish(text) if final else self.parser.feed(text)):
                if e.kind == "content":
                    if self.open_kind != "text":
                        out += self._close() + self._open({"type": "text", "text": ""})
                    out.append(self._delta({"type": "text_delta", "text": e.text}))
                elif e.kind == "start":
                    out += self._close() + self._open({"type": "tool_use", "id": e.id, "name": e.name,
                                                       "input": {}})
                else:
                    out.append(self._delta({"type": "input_json_delta", "partial_json": e.text}))
        if final:
            if self.index < 0:
                out += self._open({"type": "text", "text": ""})
            out += self._close()
        return out

    def _open(self, block: dict[str, Any]) -> list[str]:
        self.index += 1
        self.open_kind = block["type"]
        return [named_event("content_block_start", {"index": self.index, "content_block": block})]

    def _close(self) -> list[str]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [named_event("content_block_stop", {"index": self.index})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return named_event("content_block_delta", {"index": self.index, "delta": delta})
