"""Renders logged requests into the exact token ids the engine would see, with a span map
saying which token range belongs to the tools, the system prompt, each history message, the
new turn and the generation prompt. Chat requests render through prefixserve.prompt, the
server's own renderer, so a span here is the span the server reports live.

A picture is in the prompt as the engine ran it: its tokens, as many as the log recorded, each keyed
by the picture's content hash (image_key: an id past every vocabulary's, equal only for the same
picture at the same token of it). Two requests that differ only in a picture then diverge at its first
token, and the lint's cache replay forks where the engine's, whose blocks carry the picture's hash.
"""
from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

from prefixserve.diagnose.log_reader import LoggedImage, LogRecord
from prefixserve.prompt import PROMPT, Conversation, PromptRenderer, Span

_MAX_REMEMBERED = 65536
# keyed image tokens are IMAGE_KEY_BASE and above (no tokenizer has 2**31 tokens); still u32, as the
# kv code hashes token ids
IMAGE_KEY_BASE = 2**31
IMAGE_TEXT = "<image>"
IMAGE_PAD = "<|image_pad|>"


def image_key(content_hash: str, index: int) -> int:
    """The key of token `index` of the picture with this content hash."""
    digest = hashlib.blake2b(bytes.fromhex(content_hash) + index.to_bytes(4, "little"), digest_size=4)
    return IMAGE_KEY_BASE | (int.from_bytes(digest.digest(), "little") & (IMAGE_KEY_BASE - 1))


def is_image_key(token: int) -> bool:
    return token >= IMAGE_KEY_BASE


@dataclass(frozen=True)
class PlacedImage:
    image: LoggedImage
    start: int                 # its first token in the rendered prompt

    @property
    def end(self) -> int:
        return self.start + self.image.tokens


@dataclass
class RenderedRequest:
    record: LogRecord
    token_ids: list[int]
    text: Optional[str]                    # None for a completion given as token ids
    spans: list[Span]
    output_token_ids: list[int]
    images: list[PlacedImage] = field(default_factory=list)

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

    def image_at(self, position: int) -> Optional[PlacedImage]:
        for placed in self.images:
            if placed.start <= position < placed.end:
                return placed
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
                ids = self._expand(record, self._render_chat(record).token_ids)[0]
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
        ids, placed = self._expand(record, rendered.token_ids)
        self._remember(record, ids)
        return RenderedRequest(record, ids, rendered.text, _moved(rendered.spans, placed), outputs, placed)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The tokenizer's text, with a picture's run of tokens shown as IMAGE_TEXT."""
        out = []
        for image, run in itertools.groupby(ids, key=is_image_key):
            out.append(IMAGE_TEXT if image else self.tokenizer.decode(list(run),
                                                                      skip_special_tokens=skip_special_tokens))
        return "".join(out)

    def _expand(self, record: LogRecord, ids: list[int]) -> tuple[list[int], list[PlacedImage]]:
        """Each picture's one placeholder token expanded to its keyed tokens, as the engine expands it."""
        if not record.images:
            return ids, []
        pad = self.tokenizer.token_to_id(IMAGE_PAD)
        at = [i for i, t in enumerate(ids) if t == pad]
        if pad is None or len(at) != len(record.images):
            raise ValueError(f"request {record.request_id}: {len(record.images)} pictures, but the prompt "
                             f"renders {len(at)} {IMAGE_PAD} tokens (a log of another model?)")
        out: list[int] = []
        placed = []
        previous = 0
        for position, image in zip(at, record.images):
            out += ids[previous:position]
            placed.append(PlacedImage(image, len(out)))
            out += [image_key(image.content_hash, k) for k in range(image.tokens)]
            previous = position + 1
        return out + ids[previous:], placed

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


def _moved(spans: list[Span], placed: list[PlacedImage]) -> list[Span]:
    """Spans of the prompt with one placeholder per picture, moved onto the expanded prompt."""
    if not placed:
        return spans
    grown = [(p.start - sum(q.image.tokens - 1 for q in placed[:k]), p.image.tokens - 1)
             for k, p in enumerate(placed)]   # (placeholder's position before expanding, tokens added)

    def moved(position: int) -> int:
        return position + sum(extra for at, extra in grown if at < position)
    return [replace(span, start=moved(span.start), end=moved(span.end)) for span in spans]


def _content_key(record: LogRecord) -> str:
    # Key order kept (no sort_keys): reordered tool keys render differently.
    return json.dumps([record.messages, record.tools, record.prompt, record.chat_template_kwargs,
                       [(i.content_hash, i.tokens) for i in record.images]], default=repr)


def load_renderer(model: str) -> Renderer:
    """A Renderer with the tokenizer the engine would load for `model`."""
    from prefixserve.tokenizer import load_tokenizer
    return Renderer(load_tokenizer(model))
