"""dynamic-system: values that change per request (timestamps, dates, UUIDs, counters, names)
inside an otherwise stable system prompt."""
from __future__ import annotations

from typing import Optional

from prefixserve.diagnose.log_reader import LogRecord
from prefixserve.diagnose.rules.base import Finding, Pair, excerpt, system_text, with_system
from prefixserve.diagnose.textdiff import (ChangedValue, changed_values, restore_words,
                                           without_whitespace)
from prefixserve.prompt import SYSTEM

MAX_VALUES = 6          # more changed places than this is a different prompt, not a few values
MAX_VALUE_WORDS = 4
MAX_CHANGED_FRACTION = 0.2


def small_change(values: list[ChangedValue], old: str, new: str) -> bool:
    """A few short values changed in a text that otherwise stays the same."""
    if not values or len(values) > MAX_VALUES:
        return False
    if any(max(len(v.old.split()), len(v.new.split())) > MAX_VALUE_WORDS for v in values):
        return False
    changed = sum(max(len(v.old), len(v.new)) for v in values)
    return changed <= MAX_CHANGED_FRACTION * max(len(old), len(new))


class DynamicSystem:
    id = "dynamic-system"
    title = "Dynamic values inside a stable system prompt"
    fix = ("Keep the system prompt byte-identical across requests: replace per-request values "
           "(time, date, session/request ids, counters, user names) by a fixed placeholder and "
           "send the actual values at the end of the request (e.g. a short context line in "
           "the new user turn).")

    def check(self, pair: Pair) -> Optional[Finding]:
        old, new = system_text(pair.earlier), system_text(pair.current)
        if old is None or new is None or old == new:
            return None
        if without_whitespace(old) == without_whitespace(new):
            return None  # whitespace-drift's
        values = changed_values(old, new)
        if not small_change(values, old, new):
            return None
        span = pair.current.span_of(SYSTEM)
        first = values[0]
        detail = "; ".join(f"{v.kind} {v.old or '∅'} -> {v.new or '∅'}" for v in values)
        old_at = old.find(first.old) if first.old else first.new_start
        return Finding(
            self.id, pair.current.request_id, pair.earlier.request_id, pair.position_in(span),
            span.label if span else "system prompt", detail,
            excerpt(old, max(0, old_at)), excerpt(new, first.new_start),
            fix_data={"values": [w for v in values for w in v.new.split()],
                      "earlier_values": [w for v in values for w in v.old.split()]})

    def restore(self, finding: Finding, current: LogRecord,
                earlier: LogRecord) -> Optional[LogRecord]:
        # The values only: whitespace drifting in the same prompt is whitespace-drift's to undo.
        return with_system(current, restore_words(earlier.messages[0]["content"],
                                                  current.messages[0]["content"]))
