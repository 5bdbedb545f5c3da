"""volatile-prefix: content that changes per request (retrieved snippets, sampled few-shot
examples) placed before content that stays the same, so the stable part is never reused."""
from __future__ import annotations

import json
from dataclasses import replace
from typing import Optional

from prefixserve.diagnose.log_reader import LogRecord
from prefixserve.diagnose.rules.base import Finding, Pair, system_text, with_system
from prefixserve.diagnose.rules.dynamic_system import small_change
from prefixserve.diagnose.textdiff import (changed_values, line_diff, restore_leading_changes,
                                           without_whitespace)
from prefixserve.prompt import PROMPT, SYSTEM


class VolatilePrefix:
    id = "volatile-prefix"
    title = "Per-request content placed before stable content"
    fix = ("Order the prompt from most to least stable: fixed instructions, tools and documents "
           "first, then history, then per-request material (retrieved snippets, sampled "
           "examples) right before the new question.")

    def check(self, pair: Pair) -> Optional[Finding]:
        cur, old = pair.current, pair.earlier
        if cur.record.is_chat and old.record.is_chat:
            a, b, span, part = system_text(old), system_text(cur), cur.span_of(SYSTEM), "system"
            tools_after = bool(cur.record.tools) and json.dumps(cur.record.tools) == json.dumps(
                old.record.tools)
        elif isinstance(cur.record.prompt, str) and isinstance(old.record.prompt, str):
            a, b, span, part = old.record.prompt, cur.record.prompt, cur.span_of(PROMPT), "prompt"
            tools_after = False
        else:
            return None
        if a is None or b is None or without_whitespace(a) == without_whitespace(b):
            return None  # equal, or whitespace-drift's
        if small_change(changed_values(a, b), a, b):
            return None  # a few values: dynamic-system's business
        diff = line_diff(a, b)
        if not diff.changed_new:
            return None
        stable = pair.count_tokens(diff.stable_after) if diff.stable_after else 0
        if stable < pair.block_size and not tools_after:
            return None
        changed = "\n".join(diff.changed_new)
        where = "before the stable tools" if stable < pair.block_size else (
            f"before {stable} tokens of unchanged text")
        return Finding(
            self.id, cur.request_id, old.request_id, pair.position_in(span),
            span.label if span else part,
            f"{len(diff.changed_new)} changed line(s) {where}",
            "\n".join(diff.changed_old)[:120], changed[:120],
            fix_data={"part": part, "lines": diff.changed_new, "earlier_lines": diff.changed_old})

    def restore(self, finding: Finding, current: LogRecord,
                earlier: LogRecord) -> Optional[LogRecord]:
        # Only the volatile lines before stable text go back: a changed question at the end
        # of a completion prompt is the request itself, not this rule's cause.
        if finding.fix_data["part"] == "prompt":
            return replace(current, prompt=restore_leading_changes(earlier.prompt, current.prompt))
        return with_system(current, restore_leading_changes(earlier.messages[0]["content"],
                                                            current.messages[0]["content"]))
