"""What every rule sees (a request and the closest earlier request) and what it reports."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Protocol

from prefixserve.diagnose.log_reader import LogRecord
from prefixserve.diagnose.render import RenderedRequest
from prefixserve.diagnose.textdiff import without_whitespace, whitespace_only
from prefixserve.prompt import Span


@dataclass
class Pair:
    current: RenderedRequest
    earlier: RenderedRequest
    position: int                      # tokens shared from the start (first differing token)
    block_size: int
    count_tokens: Callable[[str], int]

    def position_in(self, span: Optional[Span]) -> int:
        """Where an issue in `span` starts: the divergence when it lies in the span."""
        if span is None:
            return self.position
        return self.position if span.start <= self.position < span.end else span.start


@dataclass
class Finding:
    rule: str
    request_id: str
    compared_to: str
    position: int          # token of the current request where the issue starts
    part: str
    detail: str
    before: str            # evidence from the earlier request
    after: str             # evidence from the current request
    fix_data: dict = field(default_factory=dict)
    tokens_lost: int = 0   # set by lint (see lint.py: one definition for every rule)

    def to_dict(self) -> dict:
        return {"rule": self.rule, "request_id": self.request_id, "compared_to": self.compared_to,
                "position": self.position, "part": self.part, "detail": self.detail,
                "before": self.before, "after": self.after, "tokens_lost": self.tokens_lost}


class Rule(Protocol):
    id: str
    title: str
    fix: str

    def check(self, pair: Pair) -> Optional[Finding]: ...

    def restore(self, finding: Finding, current: LogRecord,
                earlier: LogRecord) -> Optional[LogRecord]:
        """`current` with the part `finding` names made identical to `earlier`'s: the request
        as it would have been without this cause. None when the cause is not a differing part
        (short-prefix). `current` may already carry the restorations of earlier findings."""
        ...


def system_text(req: RenderedRequest) -> Optional[str]:
    msgs = req.record.messages
    if msgs and msgs[0]["role"] == "system" and isinstance(msgs[0].get("content"), str):
        return msgs[0]["content"]
    return None


def with_system(record: LogRecord, text: str) -> LogRecord:
    """The chat request with `text` as its system prompt (message 0)."""
    return replace(record, messages=[{**record.messages[0], "content": text}]
                   + [dict(m) for m in record.messages[1:]])


def message_key(msg: dict) -> str:
    """A message's identity for comparisons: role, content and tool calls."""
    return json.dumps([msg.get("role"), msg.get("content"), msg.get("tool_calls"),
                       msg.get("tool_call_id")], sort_keys=True)


def content_key(msg: dict) -> str:
    """message_key blind to whitespace in the content and to how JSON is written in tool-call
    arguments and tool results: the identity under which a message that only drifted in
    whitespace, or was re-serialised, is still the same message."""
    content = msg.get("content")
    if msg.get("role") == "tool" and isinstance(content, str):
        content = json_identity(content)
    if isinstance(content, str):
        content = without_whitespace(content)
    calls = msg.get("tool_calls")
    if isinstance(calls, list):
        calls = [{**c, "function": {**c["function"], "arguments": json_identity(c["function"].get("arguments"))}}
                 if isinstance(c, dict) and isinstance(c.get("function"), dict) else c for c in calls]
    return json.dumps([msg.get("role"), content, calls, msg.get("tool_call_id")], sort_keys=True)


def json_identity(text: object) -> object:
    """A JSON text's value written one way (keys sorted, no spaces, numbers as Python reads
    them); anything that is not JSON text is returned as it is."""
    if not isinstance(text, str):
        return text
    try:
        return json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    except ValueError:
        return text


def excerpt(text: str, start: int, width: int = 70) -> str:
    """`width` characters of text around start, with ellipses where cut."""
    lo = max(0, start - width // 3)
    hi = min(len(text), lo + width)
    out = text[lo:hi]
    return ("…" if lo > 0 else "") + out + ("…" if hi < len(text) else "")


def whitespace_equal(a: str, b: str) -> bool:
    """a and b differ only in whitespace: whitespace-drift's case, which no other rule claims."""
    return whitespace_only(a, b)
