"""Rewrites a request log as if the lint's suggested fixes had been applied, so the hit rate
after the fixes can be measured with the same cache code.

Per rule, for the tenants (salts) or requests it fired on:
  tool-order        tools sorted by name, every definition's keys sorted (whole salt).
  whitespace-drift  every text (message, system prompt, tools, completion prompt) sent as the
                    first variant the salt sent of it, variants being texts equal without
                    whitespace (whole salt): what a prompt builder that normalises once
                    produces. Replies count as sent, so history that re-wraps a reply gets
                    the reply's own text back.
  dynamic-system    every value the rule saw change is replaced by one fixed placeholder in
                    that salt's system prompts; the request's own values move to a context
                    line at the start of its last message.
  volatile-prefix   the changed lines leave the system prompt (or completion prompt) and move
                    to the context line of the last message (completion: before its last line).
  history-rewrite   the request keeps the earlier request's history verbatim and appends only
                    its own new messages (from the first message both share after the change);
                    its later turns inherit that appended history.
  history-truncation  as history-rewrite: the deleted messages stay.
  reserialized-json every tool-call arguments text and tool result sent as the first text the
                    salt sent of that JSON value (the model's own reply counts as sent).
  template-rewrite  reasoning fields left out of every message of the salt, so no later turn
                    changes how an earlier one renders.
  short-prefix      not rewritten: the fix adds content, which a simulation cannot invent.
lint applies a rule's fix to a salt only where the replay shows it does not lower that salt's
reuse (see lint.py).
A user message that was the last message of an earlier request is replaced, in later
histories, by the rewritten text that request actually sent (an app stores what it sent).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from typing import Optional

from prefixserve.diagnose.log_reader import LogRecord
from prefixserve.diagnose.rules import Finding, canonical_tools
from prefixserve.diagnose.rules.base import json_identity, message_key
from prefixserve.diagnose.rules.template_rewrite import REASONING_FIELDS
from prefixserve.tools import format_of_template, parse_tool_calls
from prefixserve.diagnose.textdiff import (EDGE_PUNCT, PATTERN_KINDS, normalize_whitespace,
                                           value_kind, without_whitespace)

PLACEHOLDER = "[see context]"
# The rules whose fixes rewrite the log (short-prefix's would have to invent content).
SIMULATED_RULES = frozenset({"tool-order", "whitespace-drift", "dynamic-system",
                             "volatile-prefix", "history-rewrite", "history-truncation",
                             "reserialized-json", "template-rewrite"})
_WORD = re.compile(r"\S+")
_PLACEHOLDER_RUN = re.compile(re.escape(PLACEHOLDER) + r"(?:\s+" + re.escape(PLACEHOLDER) + ")+")


@dataclass
class FixPlan:
    canonical_tool_salts: set = field(default_factory=set)
    whitespace_salts: set = field(default_factory=set)
    dynamic_values: dict = field(default_factory=dict)      # salt -> set of values
    volatile_lines: dict = field(default_factory=dict)      # request id -> set of normalised lines
    history: dict = field(default_factory=dict)             # request id -> (earlier id, anchor, earlier anchor)
    json_salts: set = field(default_factory=set)
    no_reasoning_salts: set = field(default_factory=set)

    @classmethod
    def from_findings(cls, findings: list[Finding], salts: dict[str, Optional[str]]) -> "FixPlan":
        plan = cls()
        for f in findings:
            salt = salts[f.request_id]
            if f.rule == "tool-order":
                plan.canonical_tool_salts.add(salt)
            elif f.rule == "whitespace-drift":
                plan.whitespace_salts.add(salt)
            elif f.rule == "dynamic-system":
                values = plan.dynamic_values.setdefault(salt, set())
                values.update(f.fix_data["values"] + f.fix_data["earlier_values"])
            elif f.rule == "volatile-prefix":
                for rid, key in ((f.request_id, "lines"), (f.compared_to, "earlier_lines")):
                    plan.volatile_lines.setdefault(rid, set()).update(
                        normalize_whitespace(line) for line in f.fix_data[key] if line.strip())
            elif f.rule == "reserialized-json":
                plan.json_salts.add(salt)
            elif f.rule == "template-rewrite":
                plan.no_reasoning_salts.add(salt)
            elif f.rule in ("history-rewrite", "history-truncation"):
                # Two edited messages in one request: findings come in prompt order, and the
                # later one's anchor lies past both edits.
                plan.history[f.request_id] = (f.compared_to, f.fix_data["anchor"],
                                              f.fix_data["earlier_anchor"])
        return plan


class Fixer:
    def __init__(self, plan: FixPlan, closest: dict[str, Optional[str]]) -> None:
        self.plan = plan
        self.closest = closest   # request id -> closest earlier request id
        self._sent: dict[tuple, str] = {}           # (salt, original last user text) -> sent text
        self._transcripts: dict[str, tuple[list[dict], int]] = {}
        self._originals: dict[str, LogRecord] = {}
        self._variants: dict[tuple, str] = {}       # (salt, text without whitespace) -> text
        self._json_variants: dict[tuple, str] = {}  # (salt, JSON value written one way) -> text

    def apply(self, records: list[LogRecord]) -> list[LogRecord]:
        return [self._fix(r) for r in records]

    def _fix(self, record: LogRecord) -> LogRecord:
        self._originals[record.request_id] = record
        if not record.is_chat:
            return self._fix_prompt(record)
        salt = record.cache_salt
        messages = self._appended_history(record)
        moved: list[str] = []
        out = []
        last = len(messages) - 1
        for index, msg in enumerate(messages):
            msg = self._json_texts(salt, msg)
            content = msg.get("content")
            if not isinstance(content, str):
                out.append(msg)
                continue
            if index < last and msg["role"] == "user" and (salt, content) in self._sent:
                out.append({**msg, "content": self._sent[(salt, content)]})
                continue
            text = content
            if index == 0 and msg["role"] == "system":
                text, taken = self._move_volatile(record.request_id, text)
                moved += taken
                text, values = self._mask_values(salt, text)
                moved += values
            # After masking: a system prompt whose values and whitespace both drift becomes one
            # text only once both are fixed.
            text = self._one_variant(salt, text)
            out.append({**msg, "content": text})
        if moved and isinstance(out[last].get("content"), str):
            original = messages[last]["content"]
            out[last] = {**out[last], "content": "Context: " + " | ".join(moved) + "\n\n"
                         + out[last]["content"]}
            if out[last]["role"] == "user":
                self._sent[(salt, original)] = out[last]["content"]
        tools = record.tools
        if tools and salt in self.plan.canonical_tool_salts:
            tools = canonical_tools(tools)
        if tools and salt in self.plan.whitespace_salts:
            tools = json.loads(self._one_variant(salt, json.dumps(tools)))
        if record.output_text is not None:
            self._one_variant(salt, record.output_text)
            if salt in self.plan.json_salts:
                for call in parse_tool_calls(record.output_text, format_of_template(None))[1]:
                    self._json_variants.setdefault((salt, json_identity(call.arguments)), call.arguments)
        return replace(record, messages=out, tools=tools)

    def _json_texts(self, salt, msg: dict) -> dict:
        """The message with its reasoning left out and its JSON texts (tool-call arguments, a
        tool result) as the salt first sent them, where those fixes apply."""
        if salt in self.plan.no_reasoning_salts:
            msg = {k: v for k, v in msg.items() if k not in REASONING_FIELDS}
        if salt not in self.plan.json_salts:
            return msg

        def first(text):
            if not isinstance(text, str):
                return text
            try:
                json.loads(text)
            except ValueError:
                return text
            return self._json_variants.setdefault((salt, json_identity(text)), text)
        if msg.get("role") == "tool":
            msg = {**msg, "content": first(msg.get("content"))}
        if isinstance(msg.get("tool_calls"), list):
            msg = {**msg, "tool_calls": [
                {**c, "function": {**c["function"], "arguments": first(c["function"].get("arguments"))}}
                if isinstance(c, dict) and isinstance(c.get("function"), dict) else c
                for c in msg["tool_calls"]]}
        return msg

    def _one_variant(self, salt, text: str) -> str:
        """The first text this salt sent that equals `text` without whitespace."""
        if salt not in self.plan.whitespace_salts:
            return text
        return self._variants.setdefault((salt, without_whitespace(text)), text)

    def _appended_history(self, record: LogRecord) -> list[dict]:
        rid = record.request_id
        msgs = record.messages
        transcript: tuple[list[dict], int] = ([], 0)
        if rid in self.plan.history:
            earlier_id, anchor, earlier_anchor = self.plan.history[rid]
            prefix, verbatim_from = self._transcripts.get(earlier_id, ([], 0))
            earlier = self._originals.get(earlier_id)
            if earlier is not None and earlier_anchor >= verbatim_from:
                transcript = (prefix + earlier.messages[verbatim_from:earlier_anchor], anchor)
        else:
            earlier_id = self.closest.get(rid)
            prefix, verbatim_from = self._transcripts.get(earlier_id, ([], 0))
            earlier = self._originals.get(earlier_id) if earlier_id else None
            if verbatim_from and earlier is not None and len(msgs) > verbatim_from and [
                    message_key(m) for m in msgs[:verbatim_from]] == [
                    message_key(m) for m in earlier.messages[:verbatim_from]]:
                transcript = (prefix, verbatim_from)
        self._transcripts[rid] = transcript
        prefix, verbatim_from = transcript
        return [dict(m) for m in prefix + msgs[verbatim_from:]]

    def _move_volatile(self, rid: str, text: str) -> tuple[str, list[str]]:
        flagged = self.plan.volatile_lines.get(rid)
        if not flagged:
            return text, []
        kept, taken = [], []
        for line in text.split("\n"):
            (taken if line.strip() and normalize_whitespace(line) in flagged else kept).append(line)
        return "\n".join(kept), taken

    def _mask_values(self, salt, text: str) -> tuple[str, list[str]]:
        """Replaces the salt's dynamic values by PLACEHOLDER: every word seen changing, and every
        word of a kind seen changing (all dates once one date changed, ...); adjacent values
        become one placeholder so "Alice Chen" and "Bob" mask alike."""
        values = self.plan.dynamic_values.get(salt)
        if not values:
            return text, []
        kinds = {value_kind(v) for v in values} & PATTERN_KINDS
        found: list[str] = []

        def mask(match: re.Match) -> str:
            word = match.group()
            core = word.strip(EDGE_PUNCT)
            if core and (core in values or value_kind(core) in kinds):
                found.append(core)
                return word.replace(core, PLACEHOLDER, 1)
            return word

        masked = _WORD.sub(mask, text)
        return _PLACEHOLDER_RUN.sub(PLACEHOLDER, masked), found

    def _fix_prompt(self, record: LogRecord) -> LogRecord:
        if not isinstance(record.prompt, str):
            return record
        text = self._one_variant(record.cache_salt, record.prompt)
        text, taken = self._move_volatile(record.request_id, text)
        if taken:
            head, _, tail = text.rpartition("\n")
            text = (head + "\n" if head else "") + "\n".join(taken) + "\n" + tail
        return replace(record, prompt=text)


def apply_fixes(records: list[LogRecord], findings: list[Finding],
                closest: dict[str, Optional[str]]) -> list[LogRecord]:
    plan = FixPlan.from_findings(findings, {r.request_id: r.cache_salt for r in records})
    return Fixer(plan, closest).apply(records)
