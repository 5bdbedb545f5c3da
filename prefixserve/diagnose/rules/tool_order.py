"""tool-order: the same tools sent in another order or re-serialised with another key order."""
from __future__ import annotations

import json
from dataclasses import replace
from typing import Optional

from prefixserve.diagnose.log_reader import LogRecord
from prefixserve.diagnose.rules.base import Finding, Pair, whitespace_equal
from prefixserve.prompt import TOOLS


def tool_name(tool: dict) -> str:
    fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
    return str(fn.get("name", ""))


def canonical_tools(tools: list[dict]) -> list[dict]:
    """Tools sorted by name, every object's keys sorted: one serialisation per tool set."""
    ordered = sorted(tools, key=lambda t: (tool_name(t), json.dumps(t, sort_keys=True)))
    return [json.loads(json.dumps(t, sort_keys=True)) for t in ordered]


class ToolOrder:
    id = "tool-order"
    title = "Same tools, different order or key order"
    fix = ("Send tools in one fixed order (e.g. sorted by name) and serialise each definition "
           "the same way every time (sorted keys); never build the list from a set or dict "
           "whose order can change.")

    def check(self, pair: Pair) -> Optional[Finding]:
        a, b = pair.earlier.record.tools, pair.current.record.tools
        if not a or not b or json.dumps(a) == json.dumps(b):
            return None
        if whitespace_equal(json.dumps(a), json.dumps(b)):
            return None  # same order and keys: whitespace-drift's
        if json.dumps(canonical_tools(a)) != json.dumps(canonical_tools(b)):
            return None
        names_a, names_b = [tool_name(t) for t in a], [tool_name(t) for t in b]
        parts = []
        if names_a != names_b:
            parts.append(f"tool order changed: {', '.join(names_a)} -> {', '.join(names_b)}")
        by_name = {tool_name(t): json.dumps(t) for t in a}
        rekeyed = [n for n, t in zip(names_b, b) if by_name.get(n) != json.dumps(t)]
        if rekeyed:
            parts.append(f"{', '.join(rekeyed)} re-serialised with a different key order")
        detail = "; ".join(parts)
        span = pair.current.span_of(TOOLS)
        return Finding(self.id, pair.current.request_id, pair.earlier.request_id,
                       pair.position_in(span), span.label if span else "tools", detail,
                       json.dumps(a)[:90] + "…", json.dumps(b)[:90] + "…")

    def restore(self, finding: Finding, current: LogRecord,
                earlier: LogRecord) -> Optional[LogRecord]:
        return replace(current, tools=earlier.tools)
