"""short-prefix: the part every request shares is shorter than one KV block, and only full
blocks are ever reused."""
from __future__ import annotations

from typing import Optional

from prefixserve.diagnose.log_reader import LogRecord
from prefixserve.diagnose.rules.base import Finding, Pair
from prefixserve.prompt import PROMPT, SYSTEM, TOOLS

MIN_SHARED_PROMPT_TOKENS = 2


class ShortPrefix:
    id = "short-prefix"
    title = "Shared prefix shorter than one block"
    fix = ("Only whole blocks are reused: a stable prefix under one block (block_size tokens) "
           "is recomputed every time. Put the stable material (instructions, tools, reference "
           "text) in the shared prefix so it spans at least one block, or serve with a smaller "
           "block size. (Not simulated: the fix adds content.)")

    def check(self, pair: Pair) -> Optional[Finding]:
        p, cur = pair.position, pair.current
        if not 0 < p < pair.block_size or p >= len(cur.token_ids) - 1:
            return None
        if cur.record.is_chat:
            stable = [s for s in (cur.span_of(SYSTEM), cur.span_of(TOOLS)) if s is not None]
            # The whole stable preamble is shared and still below a block.
            if not stable or max(s.end for s in stable) > p:
                return None
        elif p < MIN_SHARED_PROMPT_TOKENS or cur.span_of(PROMPT) is None:
            return None
        span = cur.span_at(p)
        return Finding(self.id, cur.request_id, pair.earlier.request_id, p,
                       span.label if span else "prompt",
                       f"the shared prefix is {p} tokens, below one block of {pair.block_size}",
                       "", "")

    def restore(self, finding: Finding, current: LogRecord,
                earlier: LogRecord) -> Optional[LogRecord]:
        return None  # the cause is the block granularity, not a part that differs
