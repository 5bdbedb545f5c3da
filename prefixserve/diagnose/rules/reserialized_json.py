"""reserialized-json: tool-call arguments or tool results sent again with the same JSON value
written differently (key order, spacing, number format), which tokenises differently and ends
the shared prefix at that message.

Typical causes: a client that parses the arguments the model wrote and dumps them again (its own
key order and separators, 1.50 turned into 1.5), or a tool result rebuilt from an object on
every turn. Covered: a history message's tool_calls arguments and tool results against the same
message of the earlier request, and the earlier request's own reply (the calls the model wrote)
against the assistant message that sends it back. Tool results that differ only in whitespace
are whitespace-drift's.
"""
from __future__ import annotations

import json
from dataclasses import replace
from typing import Optional

from prefixserve.diagnose.log_reader import LogRecord
from prefixserve.diagnose.rules.base import Finding, Pair, content_key, excerpt, whitespace_equal
from prefixserve.prompt import HISTORY, NEW_TURN, Span, common_prefix_len
from prefixserve.tools import format_of_template, parse_tool_calls


class ReserializedJson:
    id = "reserialized-json"
    title = "Tool arguments or results re-serialised"
    fix = ("Send tool-call arguments back exactly as the model wrote them (the arguments string of "
           "the response, not json.dumps of its parse) and keep each tool result as the text you "
           "sent the first time; if you must serialise, do it once, with fixed key order, "
           "separators and number formatting.")

    def check(self, pair: Pair) -> Optional[Finding]:
        changes = self._changes(pair)
        if not changes:
            return None
        index, what, old, new = changes[0]
        span = _span(pair, index)
        at = common_prefix_len(old, new)
        label = span.label if span else f"message {index}"
        detail = f"{what} of message {index}: the same JSON value written differently ({_how(old, new)})"
        if len(changes) > 1:
            detail += f"; {len(changes) - 1} more re-serialised"
        return Finding(self.id, pair.current.request_id, pair.earlier.request_id,
                       pair.position_in(span), label, detail, repr(excerpt(old, at, 60)),
                       repr(excerpt(new, at, 60)),
                       fix_data={"changes": [(i, w, o) for i, w, o, _ in changes]})

    def restore(self, finding: Finding, current: LogRecord,
                earlier: LogRecord) -> Optional[LogRecord]:
        messages = [dict(m) for m in current.messages]
        for index, what, old in finding.fix_data["changes"]:
            messages[index] = _with_text(messages[index], what, old)
        return replace(current, messages=messages)

    @staticmethod
    def _changes(pair: Pair) -> list[tuple[int, str, str, str]]:
        """(message index, what, earlier text, current text) of every re-serialised JSON text."""
        cur, old = pair.current.record, pair.earlier.record
        if not (cur.is_chat and old.is_chat):
            return []
        found = []
        n = min(len(old.messages), len(cur.messages))
        for i in range(n):
            x, y = old.messages[i], cur.messages[i]
            if content_key(x) != content_key(y):
                break  # a real change: messages no longer pair up (history-rewrite's case)
            found += _message_changes(i, x, y)
        reply = len(old.messages)
        if (n == reply < len(cur.messages) and old.output_text is not None
                and cur.messages[reply].get("role") == "assistant"):
            sent = cur.messages[reply].get("tool_calls") or []
            _, calls = parse_tool_calls(old.output_text, format_of_template(None))
            for j, (call, back) in enumerate(zip(calls, sent)):
                args = _arguments(back)
                if isinstance(args, str) and args != call.arguments and _same_json(args, call.arguments):
                    found.append((reply, f"tool_calls[{j}].arguments", call.arguments, args))
        return found


def _message_changes(i: int, x: dict, y: dict) -> list[tuple[int, str, str, str]]:
    out = []
    for j, (a, b) in enumerate(zip(x.get("tool_calls") or [], y.get("tool_calls") or [])):
        old, new = _arguments(a), _arguments(b)
        if isinstance(old, str) and isinstance(new, str) and old != new and _same_json(old, new):
            out.append((i, f"tool_calls[{j}].arguments", old, new))
    old, new = x.get("content"), y.get("content")
    if (x.get("role") == "tool" and isinstance(old, str) and isinstance(new, str) and old != new
            and not whitespace_equal(old, new) and _same_json(old, new)):
        out.append((i, "tool result", old, new))
    return out


def _arguments(call: object) -> object:
    function = call.get("function") if isinstance(call, dict) else None
    return function.get("arguments") if isinstance(function, dict) else None


def _with_text(message: dict, what: str, text: str) -> dict:
    if what == "tool result":
        return {**message, "content": text}
    j = int(what[len("tool_calls["):what.index("]")])
    calls = [dict(c) for c in message["tool_calls"]]
    calls[j] = {**calls[j], "function": {**calls[j]["function"], "arguments": text}}
    return {**message, "tool_calls": calls}


def _same_json(a: str, b: str) -> bool:
    try:
        return json.loads(a) == json.loads(b)
    except ValueError:
        return False


def _how(old: str, new: str) -> str:
    """Which way the two texts of one JSON value differ."""
    def keys(text: str) -> list:
        out: list = []

        def walk(v):
            if isinstance(v, dict):
                out.append(list(v))
                for item in v.values():
                    walk(item)
            elif isinstance(v, list):
                for item in v:
                    walk(item)
        walk(json.loads(text))
        return out
    if keys(old) != keys(new):
        return "key order"
    if whitespace_equal(old, new):
        return "whitespace"
    return "number format or string escapes"


def _span(pair: Pair, i: int) -> Optional[Span]:
    cur = pair.current
    return cur.span_of(HISTORY, i) or cur.span_of(NEW_TURN, i)
