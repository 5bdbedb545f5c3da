"""template-rewrite: the client appended to the conversation, yet the prompt changed inside
messages it had sent before: the chat template renders an earlier turn differently once later
turns exist.

The usual case is reasoning: Qwen3-style templates (the built-in one too) show an assistant
turn's `reasoning_content` only after the last user message, so the next user message removes
the thinking of every earlier turn and everything from the first of them on is recomputed.
Nothing in the request can be put back to undo it, so the tokens it costs are what the earlier
request's conversation would have given (its prompt up to the generation prompt, whole blocks)
beyond what was reused.
"""
from __future__ import annotations

import json
from typing import Optional

from prefixserve.diagnose.log_reader import LogRecord
from prefixserve.diagnose.rules.base import Finding, Pair, excerpt
from prefixserve.prompt import GENERATION_PROMPT, common_prefix_len

REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")


def appended_only(a: list[dict], b: list[dict]) -> bool:
    return len(a) < len(b) and json.dumps(b[:len(a)]) == json.dumps(a)


class TemplateRewrite:
    id = "template-rewrite"
    title = "Chat template rewrites earlier turns"
    fix = ("Use a chat template that renders every earlier turn the same way on every request "
           "(e.g. one that keeps reasoning in the history), or keep reasoning out of the history "
           "altogether: send assistant turns without reasoning_content from the first turn on, so "
           "no later turn changes how they render.")

    def check(self, pair: Pair) -> Optional[Finding]:
        cur, old = pair.current.record, pair.earlier.record
        # order-sensitive: tools whose keys were reordered are tool-order's, not the template's
        if not (cur.is_chat and old.is_chat) or json.dumps(cur.tools) != json.dumps(old.tools):
            return None
        if not appended_only(old.messages, cur.messages):
            return None
        generation = pair.earlier.span_of(GENERATION_PROMPT)
        conversation_end = generation.start if generation else len(pair.earlier.token_ids)
        if pair.position >= conversation_end:
            return None
        span = pair.earlier.span_at(pair.position)
        label = span.label if span else "an earlier turn"
        detail = (f"the messages of the earlier request were sent again unchanged, but the template "
                  f"renders {label} differently now that later turns follow it")
        if any(m.get(f) for m in old.messages for f in REASONING_FIELDS):
            detail += " (it drops the reasoning of assistant turns before the last user message)"
        a, b = pair.earlier.text or "", pair.current.text or ""
        at = common_prefix_len(a, b)
        reach = conversation_end // pair.block_size * pair.block_size
        return Finding(self.id, cur.request_id, old.request_id, pair.position, label, detail,
                       repr(excerpt(a, at, 60)), repr(excerpt(b, at, 60)),
                       fix_data={"reach": max(reach, pair.position)})

    def restore(self, finding: Finding, current: LogRecord,
                earlier: LogRecord) -> Optional[LogRecord]:
        return None  # the template is not part of the request: see the module docstring
