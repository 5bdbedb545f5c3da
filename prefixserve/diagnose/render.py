"""Renders logged requests into the exact token ids the engine would see, with a span map
saying which token range belongs to the tools, the system prompt, each history message, the
new turn and the generation prompt.

Spans are found without knowing the template: the rendered text of messages[:k] (no
generation prompt) shares a prefix with the full text that ends where message k-1 ends, and
rendering without tools removes exactly the tools' text. Character boundaries become token
boundaries through the tokenizer's character offsets.
"""
from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from typing import Optional, Sequence

from prefixserve.diagnose.divergence import common_prefix_len
from prefixserve.diagnose.log_reader import LogRecord

_PARTIAL_CACHE_SIZE = 8192

TOOLS, SYSTEM, HISTORY, NEW_TURN, GENERATION_PROMPT, PROMPT = (
    "tools", "system", "history", "new-turn", "generation-prompt", "prompt")


@dataclass(frozen=True)
class Span:
    kind: str                              # one of the constants above
    start: int                             # token range [start, end)
    end: int
    message_index: Optional[int] = None    # index in the request's messages (system/history/new-turn)
    role: Optional[str] = None

    @property
    def label(self) -> str:
        if self.kind == HISTORY:
            return f"history message {self.message_index} ({self.role})"
        if self.kind == NEW_TURN:
            return f"new {self.role} turn (message {self.message_index})"
        return {SYSTEM: "system prompt", TOOLS: "tools", GENERATION_PROMPT: "generation prompt",
                PROMPT: "prompt"}[self.kind]

    def to_dict(self) -> dict:
        return {"part": self.label, "kind": self.kind, "start": self.start, "end": self.end,
                "message_index": self.message_index}


@dataclass
class RenderedRequest:
    record: LogRecord
    token_ids: list[int]
    text: Optional[str]                    # None for a completion given as token ids
    spans: list[Span]
    output_token_ids: list[int]

    @property
    def request_id(self) -> str:
        return self.record.request_id

    @property
    def cache_salt(self) -> Optional[str]:
        return self.record.cache_salt

    def span_at(self, position: int) -> Optional[Span]:
        """The span holding token `position` (the last span for the end of the request)."""
        for span in self.spans:
            if span.start <= position < span.end:
                return span
        return self.spans[-1] if self.spans and position >= len(self.token_ids) else None

    def span_of(self, kind: str, message_index: Optional[int] = None) -> Optional[Span]:
        for span in self.spans:
            if span.kind == kind and (message_index is None or span.message_index == message_index):
                return span
        return None


class Renderer:
    """Turns LogRecords into RenderedRequests with one tokenizer (a prefixserve Tokenizer)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._partial_cache: dict[int, Optional[str]] = {}

    def render(self, record: LogRecord) -> RenderedRequest:
        outputs = self._output_ids(record)
        if not record.is_chat:
            if isinstance(record.prompt, list):
                ids, text = list(record.prompt), None
            else:
                # The engine encodes a text prompt with the tokenizer's special tokens.
                ids, text = self.tokenizer.encode(record.prompt, add_special_tokens=True), record.prompt
            if not ids:
                raise ValueError(f"request {record.request_id}: the prompt renders to no tokens")
            return RenderedRequest(record, ids, text, [Span(PROMPT, 0, len(ids))], outputs)
        return self._render_chat(record, outputs)

    def _apply(self, record: LogRecord, messages: list[dict], tools, generation: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=generation, tokenize=False,
            **record.chat_template_kwargs)

    def _render_chat(self, record: LogRecord, outputs: list[int]) -> RenderedRequest:
        messages, tools = record.messages, record.tools
        try:
            text = self._apply(record, messages, tools, True)
        except Exception as exc:  # template errors (raise_exception) carry the reason
            raise ValueError(f"request {record.request_id}: the chat template failed: {exc}") from exc
        # Character boundaries: ends of each message, then the tools' range.
        ends = []
        previous = 0
        for partial in self._partials(record):
            if partial is not None:  # a template may refuse a partial conversation: merge into the next
                previous = max(previous, common_prefix_len(text, partial))
            ends.append(previous)
        pieces: list[tuple[int, int, str, Optional[int]]] = []   # (char start, end, kind, msg index)
        start = 0
        last = len(messages) - 1
        for index, end in enumerate(ends):
            role = messages[index]["role"]
            kind = (SYSTEM if index == 0 and role == "system" else
                    NEW_TURN if index == last else HISTORY)
            pieces.append((start, end, kind, index))
            start = end
        pieces.append((start, len(text), GENERATION_PROMPT, None))
        if tools:
            pieces = self._cut_tools(record, messages, text, pieces)
        pieces = [p for p in pieces if p[1] > p[0]]
        ids, bounds = self._tokenize(text, [p[0] for p in pieces[1:]])
        token_starts = [0] + bounds
        token_ends = bounds + [len(ids)]
        spans = [Span(kind, s, e, index, messages[index]["role"] if index is not None else None)
                 for (_, _, kind, index), s, e in zip(pieces, token_starts, token_ends) if e > s]
        return RenderedRequest(record, ids, text, spans, outputs)

    def _partials(self, record: LogRecord) -> list[Optional[str]]:
        """Rendered text of messages[:k] for k = 1..n (None where the template refuses).
        Cached: the turns of one conversation share their partial renders."""
        head = json.dumps([record.tools, record.chat_template_kwargs])
        key = hash(head)
        out = []
        for k, msg in enumerate(record.messages, start=1):
            key = hash((key, json.dumps(msg)))
            if key not in self._partial_cache:
                if len(self._partial_cache) >= _PARTIAL_CACHE_SIZE:
                    self._partial_cache.clear()
                try:
                    text = self._apply(record, record.messages[:k], record.tools, False)
                except Exception:
                    text = None
                self._partial_cache[key] = text
            out.append(self._partial_cache[key])
        return out

    def _cut_tools(self, record: LogRecord, messages: list[dict], text: str,
                   pieces: list[tuple[int, int, str, Optional[int]]]):
        try:
            without = self._apply(record, messages, None, True)
        except Exception:
            return pieces
        head = common_prefix_len(text, without)
        tail = min(common_prefix_len(text[::-1], without[::-1]), len(without) - head)
        lo, hi = head, len(text) - tail
        if hi <= lo:
            return pieces
        out = []
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

    def _tokenize(self, text: str, char_bounds: Sequence[int]) -> tuple[list[int], list[int]]:
        """Ids of the rendered text (what apply_chat_template(tokenize=True) returns: the text
        encoded without special tokens) and the index of the first token starting at or after
        each character boundary (from the tokenizers backend's character offsets)."""
        encoding = self.tokenizer.backend.encode(text, add_special_tokens=False)
        starts = [start for start, _ in encoding.offsets]
        return list(encoding.ids), [bisect.bisect_left(starts, b) for b in char_bounds]

    def _output_ids(self, record: LogRecord) -> list[int]:
        if record.output_text is not None:
            ids = self.tokenizer.encode(record.output_text, add_special_tokens=False)
            eos = getattr(self.tokenizer, "eos_token_id", None)
            # A reply that ended by itself ends with the end-of-turn token the engine sampled.
            return ids + ([eos] if eos is not None else [])
        if record.output_tokens:
            # Only the count is known: placeholder ids occupy the right number of slots.
            return [0] * record.output_tokens
        return []


def load_renderer(model: str) -> Renderer:
    """A Renderer with the tokenizer the engine would load for `model`."""
    from prefixserve.tokenizer import load_tokenizer
    return Renderer(load_tokenizer(model))
