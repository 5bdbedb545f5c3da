"""Per-request miss explanation for a running engine or server.

The server calls MissExplainer.explain() once per request, after the engine reported how many
prompt tokens it reused, and attaches Diagnosis.to_dict() to its response as the `prefixserve`
extension object. Memory is bounded: only `max_requests` requests are remembered; beyond it
the tenant remembered for the most gives up its least recently added or matched one, so a
tenant's flood never erases another tenant's history.
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

from prefixserve.diagnose.divergence import ClosestPrefixIndex, describe_divergence
from prefixserve.prompt import Span, common_prefix_len

SpanLike = Union[Span, tuple[str, int, int]]   # a Span, or (part label, start, end)
ImageSpan = tuple[bytes, int, int]              # (content hash, first token, number of tokens)
# how a run of image tokens reads in a diagnosis's text
IMAGE_TEXT = "<image>"
CHANGED_IMAGE = ("the picture at this position differs from the earlier request's (another picture, or the "
                 "same picture at another size or encoding): the cache forks at the block holding its first "
                 "token, and every block after it is computed again")


@dataclass
class Diagnosis:
    request_id: str
    num_tokens: int
    cached_tokens: int                  # what the engine reused (num_cached_tokens)
    compared_to: Optional[str]          # the earlier request compared with
    shared_tokens: int                  # common token prefix with it
    divergence_position: Optional[int]  # first differing token; None when nothing to compare
    part: Optional[str]                 # part of this request holding that token
    current_text: str                   # text from the divergence on, this request
    earlier_text: str                   # same, earlier request
    note: Optional[str] = None          # why there is no comparison, when there is none

    def to_dict(self) -> dict:
        return {"cached_tokens": self.cached_tokens, "prompt_tokens": self.num_tokens,
                "compared_to": self.compared_to, "shared_tokens": self.shared_tokens,
                "divergence_position": self.divergence_position, "part": self.part,
                "current_text": self.current_text, "earlier_text": self.earlier_text,
                "note": self.note}


class MissExplainer:
    """Remembers recent requests and explains where each new one leaves the longest cached
    chain. Thread-safe: one lock around each call."""

    def __init__(self, decode: Optional[Callable[..., str]] = None, *,
                 max_requests: int = 1000) -> None:
        # decode(ids, skip_special_tokens=False) -> str (e.g. Tokenizer.decode); None shows ids.
        self._decode = decode
        self._index = ClosestPrefixIndex(max_entries=max_requests)
        self._spans: dict[str, list[tuple[str, int, int]]] = {}
        self._lock = threading.Lock()

    def explain(self, request_id: str, token_ids: Sequence[int], *,
                cache_salt: Optional[str] = None, num_cached_tokens: int = 0,
                spans: Optional[Sequence[SpanLike]] = None,
                diagnose_against: Optional[str] = None, remember: bool = True,
                images: Sequence[ImageSpan] = (), tenant: Optional[str] = None) -> Diagnosis:
        """Diagnoses a request against the remembered request sharing the longest token prefix
        with it (same salt), or against `diagnose_against` if given; then remembers it, as
        tenant's. images: where the prompt's images are, so that two prompts differing only in a
        picture diverge there (their token ids alone are equal)."""
        if not token_ids:
            raise ValueError(f"request {request_id!r}: token_ids is empty")
        tokens = keyed_tokens(token_ids, images)
        own_spans = [_as_tuple(s) for s in spans] if spans else []
        with self._lock:
            note = None
            if diagnose_against is not None:
                entry = self._index.get(diagnose_against)
                if entry is None or entry.salt != cache_salt:
                    # one answer for both: another salt's (tenant's) request ids are not even confirmed
                    earlier_id, note = None, (f"request {diagnose_against!r} is not remembered under "
                                              "this cache salt")
                else:
                    earlier_id = diagnose_against
            else:
                earlier_id, _ = self._index.closest(tokens, cache_salt, exclude=request_id)
                if earlier_id is None:
                    note = "no earlier request with this cache salt is remembered"
            if earlier_id is None:
                diagnosis = Diagnosis(request_id, len(tokens), num_cached_tokens, None, 0, None,
                                      None, "", "", note)
            else:
                diagnosis = self._compare(request_id, tokens, num_cached_tokens, own_spans,
                                          earlier_id)
            if remember:
                self._index.add(request_id, tokens, cache_salt, owner=tenant)
                self._spans[request_id] = own_spans
                self._spans = {rid: s for rid, s in self._spans.items() if rid in self._index}
        return diagnosis

    def remember(self, request_id: str, token_ids: Sequence[int], *,
                 cache_salt: Optional[str] = None, images: Sequence[ImageSpan] = (),
                 tenant: Optional[str] = None) -> None:
        """Remembers a request without diagnosing it (what explain(remember=True) stores, minus
        the search and decoding a diagnosis costs)."""
        if not token_ids:
            raise ValueError(f"request {request_id!r}: token_ids is empty")
        with self._lock:
            self._index.add(request_id, keyed_tokens(token_ids, images), cache_salt, owner=tenant)
            self._spans.pop(request_id, None)
            self._spans = {rid: s for rid, s in self._spans.items() if rid in self._index}

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._index.forget(request_id)
            self._spans.pop(request_id, None)

    def _compare(self, request_id: str, tokens: list[int], cached: int,
                 spans: list[tuple[str, int, int]], earlier_id: str) -> Diagnosis:
        earlier = self._index.get(earlier_id).token_ids
        lcp = common_prefix_len(earlier, tokens)
        earlier_spans = self._spans.get(earlier_id, [])
        d = describe_divergence(tokens, earlier, lcp, self._text,
                                lambda p: _part_at(spans, p), lambda p: _part_at(earlier_spans, p),
                                earlier_id)
        position = lcp if lcp < len(tokens) else None
        if position is None:
            note: Optional[str] = "this request is a prefix of the earlier one"
        elif tokens[position] < 0 or (position < len(earlier) and earlier[position] < 0):
            note = CHANGED_IMAGE
        else:
            note = None
        return Diagnosis(request_id, len(tokens), cached, earlier_id, lcp, position,
                         d.part if position is not None else None, d.current_text, d.earlier_text, note)

    def _text(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        out = []
        for is_image, run in itertools.groupby(ids, key=lambda t: t < 0):
            if is_image:
                out.append(IMAGE_TEXT)
            elif self._decode is None:
                out.append(" ".join(str(t) for t in run))
            else:
                out.append(self._decode(list(run), skip_special_tokens=skip_special_tokens))
        return ("" if self._decode is not None else " ").join(out)


def keyed_tokens(token_ids: Sequence[int], images: Sequence[ImageSpan]) -> list[int]:
    """The token ids with each image token replaced by a negative key of (its image's hash, its index in
    the image): no token id, and equal only for the same picture at the same place."""
    keyed = list(token_ids)
    for digest, start, length in images:
        base = int.from_bytes(digest[:6], "little") << 16
        for k in range(length):
            keyed[start + k] = -1 - (base | min(k, 0xFFFF))
    return keyed


def expanded_spans(spans: Sequence[SpanLike], images: Sequence[ImageSpan]) -> list[tuple[str, int, int]]:
    """Spans located on a rendered prompt whose images are one placeholder token each, moved onto the
    prompt whose images are expanded to their tokens (what the engine ran)."""
    placeholders = []   # (placeholder position in the rendered prompt, tokens it grew by)
    grown = 0
    for _, start, length in sorted(images, key=lambda i: i[1]):
        placeholders.append((start - grown, length - 1))
        grown += length - 1

    def moved(position: int) -> int:
        return position + sum(extra for at, extra in placeholders if at < position)
    return [(label, moved(start), moved(end)) for label, start, end in map(_as_tuple, spans)]


def _as_tuple(span: SpanLike) -> tuple[str, int, int]:
    if isinstance(span, Span):
        return (span.label, span.start, span.end)
    label, start, end = span
    return (str(label), int(start), int(end))


def _part_at(spans: list[tuple[str, int, int]], position: int) -> Optional[str]:
    for label, start, end in spans:
        if start <= position < end:
            return label
    return None
