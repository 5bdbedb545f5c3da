"""The lint report as text, JSON or Markdown."""
from __future__ import annotations

import json

from prefixserve.diagnose.lint import LintReport, RequestReport, RuleSummary

FORMATS = ("text", "json", "markdown")
MAX_LISTED_REQUESTS = 12


def format_lint(report: LintReport, fmt: str = "text") -> str:
    if fmt == "json":
        return json.dumps(report.to_dict(), indent=2)
    if fmt == "markdown":
        return _markdown(report)
    if fmt == "text":
        return _text(report)
    raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _ids(ids: list[str]) -> str:
    shown = ", ".join(ids[:MAX_LISTED_REQUESTS])
    return shown + (f" (+{len(ids) - MAX_LISTED_REQUESTS} more)" if len(ids) > MAX_LISTED_REQUESTS else "")


def _short(text: str, n: int = 48) -> str:
    text = json.dumps(text, ensure_ascii=False)[1:-1]
    return text[:n] + ("…" if len(text) > n else "")


def _withheld_note(report: LintReport, s: RuleSummary) -> str:
    """Empty when the rule's fix is proposed wherever it fired."""
    if not s.fix_withheld:
        return ""
    salt_of = {r.request_id: r.cache_salt for r in report.requests}
    fired = {salt_of[f.request_id] for f in s.findings}
    if fired <= set(s.fix_withheld):
        return "not proposed: replayed with this fix, the log reuses fewer tokens"
    return (f"not proposed for cache salt(s) {', '.join(map(str, s.fix_withheld))}: replayed "
            f"with this fix, their requests reuse fewer tokens")


def _rules(r: RequestReport) -> str:
    # A finding may compare with the request's own previous turn rather than with the
    # token-closest request its divergence names: then it says which.
    closest = r.divergence.compared_to if r.divergence else None
    # a rule found on two parts of one request (two edited messages) is named once
    return ", ".join(dict.fromkeys(f.rule + (f" vs {f.compared_to}" if f.compared_to != closest else "")
                                   for f in r.findings))


def _divergence_line(r: RequestReport) -> str:
    d = r.divergence
    if d is None:
        return "first request of its cache salt"
    return (f"token {d.position} in {d.part} vs {d.compared_to} ({d.earlier_part}): "
            f"\"{_short(d.current_text)}\" | earlier \"{_short(d.earlier_text)}\"")


def _text(report: LintReport) -> str:
    out = [f"prefixserve lint: {report.source} ({len(report.requests)} requests, model "
           f"{report.model}, block size {report.block_size})", "", "Summary"]
    out.append(f"  prompt tokens                 {report.tokens}")
    out.append(f"  reusable as logged            {report.reusable_tokens} ({_pct(report.hit_rate)})")
    out.append(f"  reusable after suggested fixes {report.fixed_reusable_tokens} of "
               f"{report.fixed_tokens} ({_pct(report.fixed_hit_rate)})")
    fired = [s for s in report.rules if s.findings]
    out.append("  rules fired: " + (", ".join(
        f"{s.rule} ({len(s.requests)} requests, {s.tokens_lost} tokens lost)" for s in fired)
        if fired else "none"))
    out.append("")
    for s in fired:
        out.append(f"[{s.rule}] {s.title}: {len(s.requests)} requests, {s.tokens_lost} tokens lost")
        out.append(f"  requests: {_ids(s.requests)}")
        example = max(s.findings, key=lambda f: f.tokens_lost)
        out.append(f"  example: {example.request_id} vs {example.compared_to}, token "
                   f"{example.position} ({example.part}): {example.detail}")
        if example.before or example.after:
            out.append(f"    before: {_short(example.before, 100)}")
            out.append(f"    after:  {_short(example.after, 100)}")
        out.append(f"  fix: {s.fix}")
        note = _withheld_note(report, s)
        if note:
            out.append(f"  {note}")
        out.append("")
    out.append("Requests (cache salt, tokens, reusable as logged, reusable after fixes, first divergence)")
    width = max(len(r.request_id) for r in report.requests)
    for r in report.requests:
        rules = f"  [{_rules(r)}]" if r.findings else ""
        out.append(f"  {r.request_id:<{width}}  {_salt(r):<10} {r.tokens:>6} "
                   f"{r.reusable_tokens:>6} {r.fixed_reusable_tokens:>6}  {_divergence_line(r)}{rules}")
    return "\n".join(out) + "\n"


def _salt(r) -> str:
    """A request's cache salt, or "-" for none."""
    return "-" if r.cache_salt is None else r.cache_salt


def _markdown(report: LintReport) -> str:
    out = [f"# prefixserve lint: `{report.source}`", "",
           f"{len(report.requests)} requests, model `{report.model}`, block size {report.block_size}.", "",
           "| | tokens | reusable | hit rate |", "|---|---:|---:|---:|",
           f"| as logged | {report.tokens} | {report.reusable_tokens} | {_pct(report.hit_rate)} |",
           f"| after suggested fixes | {report.fixed_tokens} | {report.fixed_reusable_tokens} | "
           f"{_pct(report.fixed_hit_rate)} |", "", "## Rules fired", ""]
    fired = [s for s in report.rules if s.findings]
    if not fired:
        out.append("None.")
    for s in fired:
        example = max(s.findings, key=lambda f: f.tokens_lost)
        out += [f"### `{s.rule}`: {s.title}", "",
                f"{len(s.requests)} requests, {s.tokens_lost} tokens lost: {_ids(s.requests)}", "",
                f"Example: `{example.request_id}` vs `{example.compared_to}`, token {example.position} "
                f"({example.part}): {example.detail}", ""]
        if example.before or example.after:
            out += ["```", f"before: {_short(example.before, 100)}",
                    f"after:  {_short(example.after, 100)}", "```", ""]
        out += [f"**Fix:** {s.fix}", ""]
        note = _withheld_note(report, s)
        if note:
            out += [f"*{note[0].upper() + note[1:]}.*", ""]
    out += ["## Requests", "", "| request | salt | tokens | reusable | after fixes | first divergence | rules |",
            "|---|---|---:|---:|---:|---|---|"]
    for r in report.requests:
        out.append(f"| {r.request_id} | {_salt(r)} | {r.tokens} | {r.reusable_tokens} | "
                   f"{r.fixed_reusable_tokens} | {_divergence_line(r).replace('|', '/')} | "
                   f"{_rules(r)} |")
    return "\n".join(out) + "\n"
