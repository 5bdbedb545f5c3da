"""Renders logged requests into the exact token ids the engine would see, with a span map
saying which token range belongs to the tools, the system prompt, each history message, the
new turn and the generation prompt. Chat requests render through prefixserve.prompt, the
server's own renderer, so a span here is the span the server reports live.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from prefixserve.diagnose.log_reader import LogRecord
from prefixserve.prompt import PROMPT, Conversation, PromptRenderer, Span

_MAX_REMEMBERED = 65536


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
        # One per chat_template_kwargs: each remembers the partial renders its spans reuse.
        self._chat: dict[str, PromptRenderer] = {}
        self._ids: dict[str, list[int]] = {}

    def prompt_ids(self, record: LogRecord) -> list[int]:
        """The prompt's token ids alone (no spans): what the lint needs for the rewritten
        requests it replays. Remembered by content, since the fix simulation renders the same
        request once per set of fixes it tries."""
        ids = self._ids.get(_content_key(record))
        if ids is None:
            if not record.is_chat:
                ids = self._prompt_ids(record)
            else:
                ids = self._render_chat(record).token_ids
            self._remember(record, ids)
        return list(ids)

    def _remember(self, record: LogRecord, ids: list[int]) -> None:
        if len(self._ids) >= _MAX_REMEMBERED:
            self._ids.clear()
        self._ids[_content_key(record)] = list(ids)

    def _prompt_ids(self, record: LogRecord) -> list[int]:
        if isinstance(record.prompt, list):
            ids = list(record.prompt)
        else:
            # The engine encodes a text prompt with the tokenizer's special tokens.
            ids = self.tokenizer.encode(record.prompt, add_special_tokens=True)
        if not ids:
            raise ValueError(f"request {record.request_id}: the prompt renders to no tokens")
        return ids

    def render(self, record: LogRecord) -> RenderedRequest:
        outputs = self._output_ids(record)
        if not record.is_chat:
            ids = self._prompt_ids(record)
            text = record.prompt if isinstance(record.prompt, str) else None
            return RenderedRequest(record, ids, text, [Span(PROMPT, 0, len(ids))], outputs)
        rendered = self._render_chat(record)
        self._remember(record, rendered.token_ids)
        return RenderedRequest(record, rendered.token_ids, rendered.text, rendered.spans, outputs)

    def _render_chat(self, record: LogRecord):
        renderer = self._chat_renderer(record.chat_template_kwargs)
        try:
            return renderer.render(Conversation.of_messages(record.messages, record.tools))
        except Exception as exc:  # template errors (raise_exception) carry the reason
            raise ValueError(f"request {record.request_id}: the chat template failed: {exc}") from exc

    def _chat_renderer(self, template_kwargs: dict) -> PromptRenderer:
        key = json.dumps(template_kwargs, sort_keys=True, default=repr)
        if key not in self._chat:
            self._chat[key] = PromptRenderer(self.tokenizer, template_kwargs=template_kwargs)
        return self._chat[key]

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


def _content_key(record: LogRecord) -> str:
    # Key order kept (no sort_keys): reordered tool keys render differently.
    return json.dumps([record.messages, record.tools, record.prompt, record.chat_template_kwargs],
                      default=repr)


def load_renderer(model: str) -> Renderer:
    """A Renderer with the tokenizer the engine would load for `model`."""
    from prefixserve.tokenizer import load_tokenizer
    return Renderer(load_tokenizer(model))
