"""tool-order: the same tools sent in another order or re-serialised with another key order."""
from __future__ import annotations

import json
from dataclasses import replace
from typing import Optional

from prefixserve.diagnose.log_reader import LogRecord
from prefixserve.diagnose.rules.base import Finding, Pair, whitespace_equal
from prefixserve.diagnose.textdiff import without_whitespace
from prefixserve.prompt import TOOLS


def tool_name(tool: dict) -> str:
    fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
    return str(fn.get("name", ""))


def canonical_tools(tools: list[dict]) -> list[dict]:
    """Tools sorted by name, every object's keys sorted: one serialisation per tool set."""
    ordered = sorted(tools, key=lambda t: (tool_name(t), json.dumps(t, sort_keys=True)))
    return [json.loads(json.dumps(t, sort_keys=True)) for t in ordered]


def tool_identity(tool: dict) -> str:
    """A tool whatever its key order and whitespace: tool-order and whitespace-drift each undo
    one of the two and leave the other to the other rule."""
    return without_whitespace(json.dumps(tool, sort_keys=True))


def shaped_like(shape: object, values: object) -> object:
    """`values` with the dict key order (recursively) of `shape`."""
    if isinstance(shape, dict) and isinstance(values, dict):
        return {**{k: shaped_like(shape[k], values[k]) for k in shape if k in values},
                **{k: v for k, v in values.items() if k not in shape}}
    if isinstance(shape, list) and isinstance(values, list) and len(shape) == len(values):
        return [shaped_like(s, v) for s, v in zip(shape, values)]
    return values


def _matched(tools: list[dict], others: list[dict]) -> Optional[list[dict]]:
    """For each tool, the one of `others` equal to it but for key order and whitespace."""
    pool: dict[str, list[dict]] = {}
    for t in others:
        pool.setdefault(tool_identity(t), []).append(t)
    out = []
    for t in tools:
        same = pool.get(tool_identity(t))
        if not same:
            return None
        out.append(same.pop(0))
    return out


def tools_reordered(tools: list[dict], earlier: list[dict]) -> list[dict]:
    """`tools` in the earlier order and key order, their texts (whitespace) kept."""
    mine = _matched(earlier, tools)
    return earlier if mine is None else [shaped_like(e, t) for e, t in zip(earlier, mine)]


def tools_restyled(tools: list[dict], earlier: list[dict]) -> list[dict]:
    """`tools` in their own order and key order with the earlier texts (whitespace)."""
    theirs = _matched(tools, earlier)
    return earlier if theirs is None else [shaped_like(t, e) for t, e in zip(tools, theirs)]


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
        if _matched(b, a) is None or len(a) != len(b):
            return None   # other tools, not the same ones reordered (whitespace aside)
        names_a, names_b = [tool_name(t) for t in a], [tool_name(t) for t in b]
        parts = []
        if names_a != names_b:
            parts.append(f"tool order changed: {', '.join(names_a)} -> {', '.join(names_b)}")
        by_name = {tool_name(t): t for t in a}
        rekeyed = [n for n, t in zip(names_b, b)
                   if json.dumps(t) != json.dumps(shaped_like(by_name.get(n), t))]
        if rekeyed:
            parts.append(f"{', '.join(rekeyed)} re-serialised with a different key order")
        detail = "; ".join(parts)
        span = pair.current.span_of(TOOLS)
        return Finding(self.id, pair.current.request_id, pair.earlier.request_id,
                       pair.position_in(span), span.label if span else "tools", detail,
                       json.dumps(a)[:90] + "…", json.dumps(b)[:90] + "…")

    def restore(self, finding: Finding, current: LogRecord,
                earlier: LogRecord) -> Optional[LogRecord]:
        return replace(current, tools=tools_reordered(current.tools, earlier.tools))
