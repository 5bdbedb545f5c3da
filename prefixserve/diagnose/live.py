"""Per-request miss explanation for a running engine or server.

The server calls MissExplainer.explain() once per request, after the engine reported how many
prompt tokens it reused, and attaches Diagnosis.to_dict() to its response as the `prefixserve`
extension object. Memory is bounded: only `max_requests` requests are remembered; beyond it
the tenant remembered for the most gives up its least recently added or matched one, so a
tenant's flood never erases another tenant's history.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

from prefixserve.diagnose.divergence import ClosestPrefixIndex, describe_divergence
from prefixserve.prompt import Span, common_prefix_len

SpanLike = Union[Span, tuple[str, int, int]]   # a Span, or (part label, start, end)


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
                tenant: Optional[str] = None) -> Diagnosis:
        """Diagnoses a request against the remembered request sharing the longest token prefix
        with it (same salt), or against `diagnose_against` if given; then remembers it, as
        tenant's."""
        if not token_ids:
            raise ValueError(f"request {request_id!r}: token_ids is empty")
        tokens = list(token_ids)
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
                 cache_salt: Optional[str] = None, tenant: Optional[str] = None) -> None:
        """Remembers a request without diagnosing it (what explain(remember=True) stores, minus
        the search and decoding a diagnosis costs)."""
        if not token_ids:
            raise ValueError(f"request {request_id!r}: token_ids is empty")
        with self._lock:
            self._index.add(request_id, list(token_ids), cache_salt, owner=tenant)
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
        return Diagnosis(request_id, len(tokens), cached, earlier_id, lcp, position,
                         d.part if position is not None else None, d.current_text, d.earlier_text,
                         None if position is not None else "this request is a prefix of the earlier one")

    def _text(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if self._decode is None:
            return " ".join(str(t) for t in ids)
        return self._decode(ids, skip_special_tokens=skip_special_tokens)


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
