"""history-rewrite: earlier turns summarised or edited instead of appended, so everything after
the first rewritten message is recomputed."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from prefixserve.diagnose.log_reader import LogRecord
from prefixserve.diagnose.rules.base import Finding, Pair, content_key, excerpt
from prefixserve.diagnose.rules.history_truncation import truncation
from prefixserve.prompt import HISTORY, common_prefix_len


class HistoryRewrite:
    id = "history-rewrite"
    title = "Conversation history rewritten instead of appended"
    fix = ("Append to the conversation; never edit, trim or summarise earlier turns in place. "
           "If the context must shrink, do it rarely and all at once (one new stable summary "
           "that later requests keep verbatim), not a little on every turn.")

    def check(self, pair: Pair) -> Optional[Finding]:
        cur, old = pair.current.record, pair.earlier.record
        if not (cur.is_chat and old.is_chat):
            return None
        a, b = old.messages, cur.messages
        if truncation(a, b) is not None:
            return None  # messages deleted, nothing rewritten: history-truncation's
        start = 1 if b[0]["role"] == "system" else 0
        # Whitespace-blind: a message that only drifted in whitespace is whitespace-drift's,
        # and the rewrite, if any, is the first message that really changed.
        first = start + common_prefix_len([content_key(m) for m in a[start:]],
                                          [content_key(m) for m in b[start:]])
        # The differing message must be history in the current request and present earlier.
        if first >= min(len(a), len(b) - 1):
            return None
        x, y = a[first].get("content"), b[first].get("content")
        anchor = self._anchor(a, b, first)
        if anchor is None:
            return None  # nothing shared after the change: another conversation, not a rewrite
        j, j_old = anchor
        if j - first == 1 and j_old - first == 1:
            detail = f"message {first} ({b[first]['role']}) edited"
        else:
            detail = (f"messages {first}..{j_old - 1} of the earlier request replaced by "
                      f"{j - first} message(s) (summarised or trimmed)")
        span = pair.current.span_of(HISTORY, first)
        return Finding(
            self.id, pair.current.request_id, pair.earlier.request_id, pair.position_in(span),
            span.label if span else f"history message {first}", detail,
            excerpt(str(x or a[first].get("tool_calls") or ""), 0),
            excerpt(str(y or b[first].get("tool_calls") or ""), 0),
            fix_data={"first": first, "anchor": j, "earlier_anchor": j_old})

    def restore(self, finding: Finding, current: LogRecord,
                earlier: LogRecord) -> Optional[LogRecord]:
        # The earlier request's history verbatim up to the anchor, then this request's turns:
        # what an append-only client would have sent.
        first, j, j_old = (finding.fix_data[k] for k in ("first", "anchor", "earlier_anchor"))
        messages = current.messages[:first] + earlier.messages[first:j_old] + current.messages[j:]
        return replace(current, messages=[dict(m) for m in messages])

    @staticmethod
    def _anchor(a: list[dict], b: list[dict], first: int) -> Optional[tuple[int, int]]:
        """First message after the change that both requests contain: (index in b, in a)."""
        where = {}
        for i in range(first + 1, len(a)):
            where.setdefault(content_key(a[i]), i)
        for j in range(first + 1, len(b)):
            i = where.get(content_key(b[j]))
            if i is not None and (b[j].get("content") or b[j].get("tool_calls")):
                return j, i
        return None
