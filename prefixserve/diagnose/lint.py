"""`lint`: why the requests of a log miss the prefix cache, and what fixing it would gain.

For each request, in log order: render it (chat template + tokenizer), find the closest
earlier request with the same salt (longest common token prefix) and the first token where
they differ, and run every rule on the pair. "Reusable" tokens come from replaying the log
through prefixserve.kv with a pool that never evicts, so they are exactly what the engine
would reuse with unbounded memory. The log is then rewritten as if every suggested fix were
applied (see fixes.py) and replayed again; a request's gain is credited to its first finding.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from prefixserve.diagnose.divergence import ClosestPrefixIndex, Divergence, describe_divergence
from prefixserve.diagnose.fixes import apply_fixes
from prefixserve.diagnose.log_reader import LogRecord
from prefixserve.diagnose.render import RenderedRequest, Renderer
from prefixserve.diagnose.replay import ReplayRequest, replay_unbounded
from prefixserve.diagnose.rules import RULES, Finding, Pair


@dataclass
class RequestReport:
    request_id: str
    cache_salt: Optional[str]
    tokens: int
    reusable_tokens: int
    fixed_tokens: int
    fixed_reusable_tokens: int
    divergence: Optional[Divergence]
    findings: list[Finding]

    def to_dict(self) -> dict:
        return {"request_id": self.request_id, "cache_salt": self.cache_salt,
                "tokens": self.tokens, "reusable_tokens": self.reusable_tokens,
                "after_fixes": {"tokens": self.fixed_tokens,
                                "reusable_tokens": self.fixed_reusable_tokens},
                "divergence": self.divergence.to_dict() if self.divergence else None,
                "rules": [f.rule for f in self.findings]}


@dataclass
class RuleSummary:
    rule: str
    title: str
    fix: str
    findings: list[Finding]

    @property
    def requests(self) -> list[str]:
        return list(dict.fromkeys(f.request_id for f in self.findings))

    @property
    def tokens_lost(self) -> int:
        return sum(f.tokens_lost for f in self.findings)

    def to_dict(self) -> dict:
        return {"rule": self.rule, "title": self.title, "fix": self.fix,
                "requests": self.requests, "tokens_lost": self.tokens_lost,
                "findings": [f.to_dict() for f in self.findings]}


@dataclass
class LintReport:
    source: str
    model: str
    block_size: int
    requests: list[RequestReport]
    rules: list[RuleSummary] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.requests)

    @property
    def reusable_tokens(self) -> int:
        return sum(r.reusable_tokens for r in self.requests)

    @property
    def fixed_tokens(self) -> int:
        return sum(r.fixed_tokens for r in self.requests)

    @property
    def fixed_reusable_tokens(self) -> int:
        return sum(r.fixed_reusable_tokens for r in self.requests)

    @property
    def hit_rate(self) -> float:
        return self.reusable_tokens / self.tokens if self.tokens else 0.0

    @property
    def fixed_hit_rate(self) -> float:
        return self.fixed_reusable_tokens / self.fixed_tokens if self.fixed_tokens else 0.0

    def fired(self) -> list[str]:
        return [s.rule for s in self.rules if s.findings]

    def to_dict(self) -> dict:
        return {"source": self.source, "model": self.model, "block_size": self.block_size,
                "summary": {"requests": len(self.requests), "tokens": self.tokens,
                            "reusable_tokens": self.reusable_tokens, "hit_rate": self.hit_rate,
                            "after_fixes": {"tokens": self.fixed_tokens,
                                            "reusable_tokens": self.fixed_reusable_tokens,
                                            "hit_rate": self.fixed_hit_rate},
                            "rules_fired": self.fired()},
                "rules": [s.to_dict() for s in self.rules if s.findings],
                "requests": [r.to_dict() for r in self.requests]}


def to_replay(rendered: list[RenderedRequest]) -> list[ReplayRequest]:
    return [ReplayRequest(r.request_id, r.token_ids, r.cache_salt, r.output_token_ids)
            for r in rendered]


def cached_sequence(r: RenderedRequest) -> list[int]:
    """The tokens the engine leaves in the cache: the prompt, plus the reply when its text is
    logged (a count alone gives placeholders, which never match anything)."""
    return r.token_ids + (r.output_token_ids if r.record.output_text is not None else [])


def lint(records: list[LogRecord], renderer: Renderer, *, block_size: int = 16,
         source: str = "", model: str = "") -> LintReport:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    rendered = [renderer.render(r) for r in records]
    hits = replay_unbounded(to_replay(rendered), block_size).hits

    def count_tokens(text: str) -> int:
        return len(renderer.tokenizer.encode(text, add_special_tokens=False))

    index = ClosestPrefixIndex()
    by_id = {r.request_id: r for r in rendered}
    if len(by_id) != len(rendered):
        raise ValueError("request ids in the log are not unique")
    closest: dict[str, Optional[str]] = {}
    divergences: dict[str, Optional[Divergence]] = {}
    findings: dict[str, list[Finding]] = {}
    for req in rendered:
        earlier_id, lcp = index.closest(req.token_ids, req.cache_salt)
        closest[req.request_id] = earlier_id
        found: list[Finding] = []
        if earlier_id is None:
            divergences[req.request_id] = None
        else:
            earlier = by_id[earlier_id]
            divergences[req.request_id] = describe_divergence(
                req.token_ids, index.get(earlier_id).token_ids, lcp, renderer.tokenizer.decode,
                req.span_at, lambda p, e=earlier: _earlier_part(e, p), earlier_id)
            pair = Pair(req, earlier, lcp, block_size, count_tokens)
            found = [f for f in (rule.check(pair) for rule in RULES) if f is not None]
            found.sort(key=lambda f: f.position)
        findings[req.request_id] = found
        index.add(req.request_id, cached_sequence(req), req.cache_salt)

    all_findings = [f for fs in findings.values() for f in fs]
    fixed_records = apply_fixes(records, all_findings, closest)
    fixed = [renderer.render(r) for r in fixed_records]
    fixed_hits = replay_unbounded(to_replay(fixed), block_size).hits

    reports = []
    for req, hit, fixed_req, fixed_hit in zip(rendered, hits, fixed, fixed_hits):
        found = findings[req.request_id]
        primary = next((f for f in found if f.rule != "short-prefix"), None)
        if primary is not None:
            primary.tokens_lost = max(0, fixed_hit - hit)
        reports.append(RequestReport(
            req.request_id, req.cache_salt, len(req.token_ids), hit, len(fixed_req.token_ids),
            fixed_hit, divergences[req.request_id], found))
    summaries = [RuleSummary(rule.id, rule.title, rule.fix,
                             [f for f in all_findings if f.rule == rule.id]) for rule in RULES]
    return LintReport(source, model, block_size, reports, summaries)


def _earlier_part(earlier: RenderedRequest, position: int) -> str:
    if position >= len(cached_sequence(earlier)):
        return "end of the earlier request"
    if position >= len(earlier.token_ids):
        return "its generated reply"
    span = earlier.span_at(position)
    return span.label if span else "?"
