"""history-truncation: a conversation shortened by deleting messages from its middle or its
newest end, where the advice (and the cache) wants it cut from the oldest end, rarely.

Deleting messages i..j-1 keeps the prefix up to i cached but recomputes everything after it on
every request that deletes again; dropping the newest turns (a tool call and its result, a
retried answer) throws away the most recent, already computed, context. A prompt that keeps its
history verbatim and, when it must shrink, drops the oldest turns after the system prompt in one
large step, pays for the shrink once.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from prefixserve.diagnose.log_reader import LogRecord
from prefixserve.diagnose.rules.base import Finding, Pair, content_key, excerpt
from prefixserve.prompt import HISTORY, NEW_TURN, common_prefix_len

# Dropping just the last message is a retried or edited question, not a truncation.
MIN_NEWEST_DROPPED = 2


def truncation(a: list[dict], b: list[dict]) -> Optional[tuple[int, int, str]]:
    """(first dropped, first kept after them, "middle" | "newest end") when b is a with a run of
    messages deleted (then possibly new ones appended), not at the oldest end; None otherwise."""
    start = 1 if a and b and a[0]["role"] == "system" and b[0]["role"] == "system" else 0
    ka, kb = [content_key(m) for m in a], [content_key(m) for m in b]
    first = start + common_prefix_len(ka[start:], kb[start:])
    if first >= len(a) or first == start:
        return None
    if first < len(b):
        for m in range(first + 1, len(a)):
            rest = ka[m:]
            if kb[first:first + len(rest)] == rest:
                return first, m, "middle"
    # newest end: none of the dropped messages comes back later (else they were rewritten)
    if len(a) - first >= MIN_NEWEST_DROPPED and not set(ka[first:]) & set(kb[first:]):
        return first, len(a), "newest end"
    return None


class HistoryTruncation:
    id = "history-truncation"
    title = "History truncated from the middle or the newest end"
    fix = ("Keep the history verbatim and append to it; when it must shrink, drop the oldest turns "
           "after the system prompt, many at once and rarely (each shrink recomputes what "
           "follows once), never a few messages in the middle or the latest tool results.")

    def check(self, pair: Pair) -> Optional[Finding]:
        cur, old = pair.current.record, pair.earlier.record
        if not (cur.is_chat and old.is_chat):
            return None
        found = truncation(old.messages, cur.messages)
        if found is None:
            return None
        first, kept, where = found
        span = pair.current.span_of(HISTORY, first) or pair.current.span_of(NEW_TURN, first)
        dropped = old.messages[first:kept]
        detail = (f"messages {first}..{kept - 1} of the earlier request ({len(dropped)}, from its "
                  f"{where}) were deleted; what follows them is recomputed")
        return Finding(self.id, cur.request_id, old.request_id, pair.position_in(span),
                       span.label if span else f"history message {first}", detail,
                       excerpt(str(dropped[0].get("content") or dropped[0].get("tool_calls") or ""), 0),
                       excerpt(str(cur.messages[first].get("content") or ""), 0),
                       fix_data={"first": first, "anchor": first, "earlier_anchor": kept})

    def restore(self, finding: Finding, current: LogRecord,
                earlier: LogRecord) -> Optional[LogRecord]:
        first, kept = finding.fix_data["first"], finding.fix_data["earlier_anchor"]
        messages = current.messages[:first] + earlier.messages[first:kept] + current.messages[first:]
        return replace(current, messages=[dict(m) for m in messages])
