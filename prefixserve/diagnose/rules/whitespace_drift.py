"""whitespace-drift: the same text sent with different whitespace or line ends, which
tokenises differently and breaks the shared prefix.

A part whose earlier and current texts differ only in whitespace (textdiff.whitespace_only:
equal once every whitespace character is deleted) belongs to this rule whatever else its
change looks like: a blank line inserted between sentences is no volatile content, no
dynamic value and no history rewrite. The other rules leave such parts alone, and lint drops
any other finding on a part this rule claims. A system prompt whose words also changed (a
timestamp) is this rule's too where the same words sit between different whitespace: each
mistake is reported, and each restore undoes its own (textdiff.restore_words).
"""
from __future__ import annotations

import json
from dataclasses import replace
from typing import Optional

from prefixserve.diagnose.log_reader import LogRecord
from prefixserve.diagnose.rules.base import Finding, Pair, content_key, excerpt, whitespace_equal
from prefixserve.diagnose.rules.tool_order import tools_restyled
from prefixserve.diagnose.textdiff import restore_words, whitespace_drifts
from prefixserve.prompt import HISTORY, NEW_TURN, PROMPT, SYSTEM, TOOLS, Span, common_prefix_len


class WhitespaceDrift:
    id = "whitespace-drift"
    title = "Same text, different whitespace"
    fix = ("Build prompts deterministically: one line-ending style (LF), one separator between "
           "sentences and paragraphs, no trailing spaces, single spaces between words, no stray "
           "leading/trailing newlines. Normalise text once where it enters your prompt builder.")

    def check(self, pair: Pair) -> Optional[Finding]:
        drifted = [p for p in self._parts(pair) if whitespace_equal(p[2], p[3])
                   or (p[1] == ("message", 0) and p[0] is not None and p[0].kind == SYSTEM
                       and whitespace_drifts(p[2], p[3]))]
        if not drifted:
            return None
        drifted.sort(key=lambda p: pair.position_in(p[0]))
        span, _, a, b = drifted[0]
        labels = [self._label(p[0], p[1]) for p in drifted]
        what = "texts equal without whitespace differ" if whitespace_equal(a, b) else (
            "same words, different whitespace")
        a = restore_words(b, a)   # b's words in a's whitespace: a itself when only whitespace differs
        at = common_prefix_len(a, b)
        detail = f"{what} at character {at}: {a[at:at + 6]!r} vs {b[at:at + 6]!r}"
        if len(drifted) > 1:
            detail += f"; also drifted: {', '.join(labels[1:])}"
        return Finding(
            self.id, pair.current.request_id, pair.earlier.request_id, pair.position_in(span),
            labels[0], detail, repr(excerpt(a, at, 50)), repr(excerpt(b, at, 50)),
            fix_data={"parts": [p[1] for p in drifted], "labels": labels})

    def restore(self, finding: Finding, current: LogRecord,
                earlier: LogRecord) -> Optional[LogRecord]:
        messages = [dict(m) for m in current.messages] if current.is_chat else None
        tools, prompt = current.tools, current.prompt
        for kind, index in finding.fix_data["parts"]:
            # The current words in the earlier whitespace: the earlier text itself unless
            # another mistake changed words in the same part.
            if kind == "prompt":
                prompt = restore_words(prompt, earlier.prompt)
            elif kind == "tools":
                tools = tools_restyled(tools, earlier.tools)
            elif kind == "message":
                messages[index]["content"] = restore_words(messages[index]["content"],
                                                           earlier.messages[index]["content"])
            elif kind == "reply":
                messages[index]["content"] = restore_words(messages[index]["content"],
                                                           earlier.output_text)
        return replace(current, messages=messages, tools=tools, prompt=prompt)

    @staticmethod
    def _parts(pair: Pair) -> list[tuple[Optional[Span], tuple[str, Optional[int]], str, str]]:
        """(span in the current request, part id, earlier text, current text) of every part the
        two requests both have."""
        cur, old = pair.current.record, pair.earlier.record
        if not cur.is_chat and not old.is_chat:
            if isinstance(cur.prompt, str) and isinstance(old.prompt, str):
                return [(pair.current.span_of(PROMPT), ("prompt", None), old.prompt, cur.prompt)]
            return []
        if not (cur.is_chat and old.is_chat):
            return []
        parts = []
        if cur.tools and old.tools:
            parts.append((pair.current.span_of(TOOLS), ("tools", None), json.dumps(old.tools),
                          json.dumps(cur.tools)))
        aligned = 0
        for i in range(min(len(cur.messages), len(old.messages))):
            x, y = old.messages[i], cur.messages[i]
            if content_key(x) != content_key(y):
                break  # past a real difference messages no longer pair up by index
            aligned = i + 1
            if isinstance(x.get("content"), str) and isinstance(y.get("content"), str):
                parts.append((_message_span(pair, i), ("message", i), x["content"], y["content"]))
        # The reply the earlier request generated, sent back as the next assistant message: its
        # tokens are cached, so a client that strips or re-wraps it loses them.
        i = len(old.messages)
        if (aligned == i < len(cur.messages) and old.output_text is not None
                and cur.messages[i].get("role") == "assistant"
                and isinstance(cur.messages[i].get("content"), str)):
            parts.append((_message_span(pair, i), ("reply", i), old.output_text,
                          cur.messages[i]["content"]))
        return parts

    @staticmethod
    def _label(span: Optional[Span], part: tuple[str, Optional[int]]) -> str:
        if span is not None:
            return span.label
        kind, index = part
        return kind if index is None else f"message {index}"


def _message_span(pair: Pair, i: int) -> Optional[Span]:
    cur = pair.current
    if i == 0 and cur.record.messages[0]["role"] == "system":
        return cur.span_of(SYSTEM)
    return cur.span_of(HISTORY, i) or cur.span_of(NEW_TURN, i)
