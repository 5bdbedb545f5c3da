"""The span map of a rendered conversation: which tokens are the tools, the system prompt, each
history message, the new turn and the generation prompt (see render.py for the method)."""
from __future__ import annotations

import json
from typing import Any, Callable, Optional

from prefixserve.prompt.common_prefix import common_prefix_len
from prefixserve.prompt.span import GENERATION_PROMPT, HISTORY, NEW_TURN, SYSTEM, TOOLS, Span

_Piece = tuple[int, int, str, Optional[int]]   # (char start, char end, kind, turn index)


class PartialRenders:
    """Renderings of a conversation's first k messages without the generation prompt (None
    where the template refuses one), remembered across conversations: the requests of one chat
    repeat all their earlier turns, and a request log holds thousands of them."""

    def __init__(self, render: Callable[[list[dict[str, Any]], list[dict[str, Any]]], str],
                 max_entries: int = 8192) -> None:
        self._render = render   # (messages, tools) -> text without the generation prompt
        self._max_entries = max_entries
        # A trie over (tools, message 1, message 2, ...): (parent node, JSON of the step) -> node.
        self._nodes: dict[tuple[int, str], int] = {}
        self._texts: dict[int, Optional[str]] = {}

    def of(self, messages: list[dict[str, Any]],
           tools: list[dict[str, Any]]) -> list[Optional[str]]:
        if len(self._nodes) + len(messages) + 1 > self._max_entries:
            self._nodes.clear()
            self._texts.clear()
        node = self._node(-1, tools)
        out = []
        for k, message in enumerate(messages, start=1):
            node = self._node(node, message)
            if node not in self._texts:
                try:
                    text: Optional[str] = self._render(messages[:k], tools)
                except Exception:  # a template may refuse a partial conversation (roles, order)
                    text = None
                self._texts[node] = text
            out.append(self._texts[node])
        return out

    def _node(self, parent: int, step: object) -> int:
        key = (parent, json.dumps(step, ensure_ascii=False, default=repr))
        return self._nodes.setdefault(key, len(self._nodes))


def locate_spans(roles: list[Optional[str]], text: str, partials: list[Optional[str]],
                 without_tools: Optional[str], tokens_by: Callable[[int], int]) -> list[Span]:
    """Spans of `text`, the rendering of messages with these roles. partials: PartialRenders.of
    the messages; without_tools: their rendering with no tools (None: no tools, or the template
    refused)."""
    pieces: list[_Piece] = []
    start = 0
    last = len(roles) - 1
    for index, partial in enumerate(partials):
        end = start if partial is None else max(start, common_prefix_len(text, partial))
        kind = (SYSTEM if index == 0 and roles[0] == "system" else
                NEW_TURN if index == last else HISTORY)
        pieces.append((start, end, kind, index))   # a refused partial merges into the next turn
        start = end
    pieces.append((start, len(text), GENERATION_PROMPT, None))
    if without_tools is not None:
        pieces = _cut_tools(text, without_tools, pieces)
    bounds = [tokens_by(s) for s, _, _, _ in pieces[1:]]
    spans = []
    for (_, _, kind, index), s, e in zip(pieces, [0] + bounds, bounds + [tokens_by(len(text))]):
        if e > s:
            spans.append(Span(kind, s, e, index, roles[index] if index is not None else None))
    return spans


def _cut_tools(text: str, without: str, pieces: list[_Piece]) -> list[_Piece]:
    """The pieces with the tools' text (what rendering without tools removes) as its own piece."""
    head = common_prefix_len(text, without)
    tail = min(common_prefix_len(text[::-1], without[::-1]), len(without) - head)
    lo, hi = head, len(text) - tail
    if hi <= lo:
        return pieces
    out: list[_Piece] = []
    for start, end, kind, index in pieces:
        if end <= lo or start >= hi:
            out.append((start, end, kind, index))
            continue
        if start < lo:
            out.append((start, lo, kind, index))
        if not out or out[-1][2] != TOOLS:
            out.append((lo, hi, TOOLS, None))
        if end > hi:
            out.append((hi, end, kind, index))
    return out
