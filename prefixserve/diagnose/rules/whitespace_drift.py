"""whitespace-drift: the same text sent with different whitespace or line ends, which
tokenises differently and breaks the shared prefix."""
from __future__ import annotations

from typing import Optional

from prefixserve.diagnose.rules.base import Finding, Pair, excerpt, system_text, whitespace_equal
from prefixserve.prompt import HISTORY, NEW_TURN, PROMPT, SYSTEM, common_prefix_len


class WhitespaceDrift:
    id = "whitespace-drift"
    title = "Same text, different whitespace"
    fix = ("Build prompts deterministically: one line-ending style (LF), no trailing spaces, "
           "single spaces between words, no stray leading/trailing newlines. Normalise text "
           "once where it enters your prompt builder.")

    def check(self, pair: Pair) -> Optional[Finding]:
        cur, old = pair.current.record, pair.earlier.record
        candidates = []
        if not cur.is_chat and not old.is_chat and isinstance(cur.prompt, str) and isinstance(old.prompt, str):
            candidates.append((pair.current.span_of(PROMPT), old.prompt, cur.prompt))
        elif cur.is_chat and old.is_chat:
            a, b = system_text(pair.earlier), system_text(pair.current)
            if a is not None and b is not None:
                candidates.append((pair.current.span_of(SYSTEM), a, b))
            for i in range(1 if b is not None else 0, min(len(cur.messages), len(old.messages))):
                x, y = old.messages[i], cur.messages[i]
                if x["role"] == y["role"] and isinstance(x.get("content"), str) and isinstance(y.get("content"), str):
                    span = (pair.current.span_of(HISTORY, i) or pair.current.span_of(NEW_TURN, i))
                    candidates.append((span, x["content"], y["content"]))
        for span, a, b in candidates:
            if whitespace_equal(a, b):
                at = common_prefix_len(a, b)
                return Finding(
                    self.id, pair.current.request_id, pair.earlier.request_id,
                    pair.position_in(span), span.label if span else "prompt",
                    f"texts equal after normalising whitespace differ at character {at}: "
                    f"{a[at:at + 6]!r} vs {b[at:at + 6]!r}",
                    repr(excerpt(a, at, 50)), repr(excerpt(b, at, 50)))
        return None
