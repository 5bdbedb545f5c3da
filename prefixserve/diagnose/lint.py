"""`lint`: why the requests of a log miss the prefix cache, what each cause costs, and what
fixing it would gain.

"Reusable" tokens come from replaying the log through prefixserve.kv with a pool that never
evicts, so they are exactly what the engine would reuse with unbounded memory.

Comparison. For each request R, in log order: render it (chat template + tokenizer) and report
the first token where it differs from the closest earlier request with the same salt (longest
common token prefix). Rules run on R paired with that request and with the earlier request
holding the most of R's conversation (messages compared whitespace-blind): a mistake early in
the prompt (a timestamp, shuffled tools, drifting whitespace) can make another conversation the
token-closest one while R's own previous turn is what it would have reused. The pair kept is
the one whose findings explain the most reuse. A part that differs only in whitespace is
whitespace-drift's, whichever other rule would also match it.

Looking again. A mistake can hide behind another in the same part or behind it: whitespace
drifting in a system prompt that also carries a timestamp, in tools that are also shuffled, in
a history that was also rewritten. So once the findings' parts are restored, the rules run
again on the restored request against E, until no rule finds a part not reported yet; each
restore undoes its own mistake only (dynamic-system the values, whitespace-drift the
whitespace, tool-order the order), so they compose in any order.

Tokens lost, one definition for every rule. Let E be the earlier request R is compared with and
f_1..f_n R's findings in prompt order: by the first token of R that undoing f_k alone changes.
R_0 = R; R_k = R_{k-1} with the part f_k names made identical to E's (the rule's `restore`).
reach(R_k) = the prompt tokens the engine reuses for
R_k: a lookup (find_cached_prefix) in the cache exactly as the requests logged before R left
it. Then

    tokens_lost(f_k) = max(0, reach(R_k) - max(reach(R_0), ..., reach(R_{k-1})))

the tokens after the divergence that the engine would have reused had that part been E's,
beyond what the earlier causes already account for: a request's findings split its recoverable
reuse without counting a token twice, and a later cause is not hidden by an earlier one.
short-prefix has no differing part (its cause is the block granularity): its reach is the
shared prefix counted token by token, i.e. what one-token blocks would reuse. A finding that
loses no token explains no miss and is not reported, so a reported loss is never 0.

Fixes. Per salt, the log is rewritten as if the fired rules' fixes were applied (fixes.py) and
replayed through the same kv code. A fix that would lower the salt's predicted reuse is
withdrawn (the fix whose removal gains most goes first, until removing any would not gain), so
"reusable after fixes" is never below "reusable as logged", and a withdrawn fix is reported as
not proposed for that salt.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from prefixserve.diagnose.divergence import ClosestPrefixIndex, Divergence, describe_divergence
from prefixserve.diagnose.fixes import SIMULATED_RULES, apply_fixes
from prefixserve.diagnose.log_reader import LogRecord
from prefixserve.diagnose.render import RenderedRequest, Renderer
from prefixserve.diagnose.replay import ReplayRequest, replay_unbounded
from prefixserve.diagnose.rules import RULES, RULES_BY_ID, Finding, Pair
from prefixserve.diagnose.rules.base import content_key
from prefixserve.prompt import common_prefix_len


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
    # The earlier request its findings compare with (the closest one when it has none); the
    # fix simulation continues that request's conversation.
    compared_to: Optional[str] = None

    def to_dict(self) -> dict:
        return {"request_id": self.request_id, "cache_salt": self.cache_salt,
                "compared_to": self.compared_to,
                "tokens": self.tokens, "reusable_tokens": self.reusable_tokens,
                "after_fixes": {"tokens": self.fixed_tokens,
                                "reusable_tokens": self.fixed_reusable_tokens},
                "divergence": self.divergence.to_dict() if self.divergence else None,
                "rules": list(dict.fromkeys(f.rule for f in self.findings))}


@dataclass
class RuleSummary:
    rule: str
    title: str
    fix: str
    findings: list[Finding]
    # salts the rule fired for whose simulated fix would have lowered reuse: not proposed there
    fix_withheld: list[Optional[str]] = field(default_factory=list)

    @property
    def requests(self) -> list[str]:
        return list(dict.fromkeys(f.request_id for f in self.findings))

    @property
    def tokens_lost(self) -> int:
        return sum(f.tokens_lost for f in self.findings)

    def to_dict(self) -> dict:
        return {"rule": self.rule, "title": self.title, "fix": self.fix,
                "requests": self.requests, "tokens_lost": self.tokens_lost,
                "fix_withheld_for": self.fix_withheld,
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


class ConversationIndex:
    """Finds the earlier request (same salt) holding the most of a request's conversation: its
    messages after the system prompt, compared whitespace-blind and weighted by length, an
    earlier request's logged reply counting as the assistant message that follows it. That is
    the request's own previous turn when it has one, whatever happened to its preamble."""

    MAX_PER_MESSAGE = 32   # a message every request repeats (a fixed example) names only recent ones

    def __init__(self) -> None:
        self._holders: dict[tuple, list[str]] = {}
        self._order: dict[str, int] = {}

    def add(self, record: LogRecord) -> None:
        keys = {content_key(m) for m in _conversation(record)}
        if record.output_text is not None:
            keys.add(content_key({"role": "assistant", "content": record.output_text}))
        for key in keys:
            holders = self._holders.setdefault((record.cache_salt, key), [])
            holders.append(record.request_id)
            if len(holders) > self.MAX_PER_MESSAGE:
                del holders[0]
        self._order[record.request_id] = len(self._order)

    def closest(self, record: LogRecord) -> Optional[str]:
        scores: dict[str, int] = {}
        for msg in _conversation(record):
            content = msg.get("content")
            weight = 1 + (len(content) if isinstance(content, str) else 0)
            for rid in self._holders.get((record.cache_salt, content_key(msg)), ()):
                scores[rid] = scores.get(rid, 0) + weight
        if not scores:
            return None
        return max(scores, key=lambda rid: (scores[rid], self._order[rid]))


def _conversation(record: LogRecord) -> list[dict]:
    if not record.is_chat:
        return []
    msgs = record.messages
    return msgs[1:] if msgs and msgs[0]["role"] == "system" else msgs


# How a finding's reach is measured: a probe's kv hit, the shared prefix counted token by token
# (short-prefix), or nothing new (its part could not be restored).
_Reach = Union[tuple[str, int], tuple[str]]


@dataclass
class _Candidate:
    """R paired with one earlier request: the findings and the counterfactual prompts R_1..R_k."""
    earlier_id: str
    findings: list[Finding]
    reaches: list[_Reach]
    probes: list[list[int]]
    score: int = 0


def lint(records: list[LogRecord], renderer: Renderer, *, block_size: int = 16,
         source: str = "", model: str = "") -> LintReport:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    rendered = [renderer.render(r) for r in records]

    def count_tokens(text: str) -> int:
        return len(renderer.tokenizer.encode(text, add_special_tokens=False))

    index = ClosestPrefixIndex()
    conversations = ConversationIndex()
    by_id = {r.request_id: r for r in rendered}
    if len(by_id) != len(rendered):
        raise ValueError("request ids in the log are not unique")
    closest: dict[str, Optional[str]] = {}
    divergences: dict[str, Optional[Divergence]] = {}
    candidates: dict[str, list[_Candidate]] = {}
    for req in rendered:
        earlier_id, lcp = index.closest(req.token_ids, req.cache_salt)
        closest[req.request_id] = earlier_id
        divergences[req.request_id] = None
        candidates[req.request_id] = []
        if earlier_id is not None:
            earlier = by_id[earlier_id]
            divergences[req.request_id] = describe_divergence(
                req.token_ids, index.get(earlier_id).token_ids, lcp, renderer.decode,
                req.span_at, lambda p, e=earlier: _earlier_part(e, p), earlier_id)
            own = conversations.closest(req.record)
            for eid in dict.fromkeys(e for e in (earlier_id, own) if e is not None):
                shared = lcp if eid == earlier_id else common_prefix_len(
                    req.token_ids, index.get(eid).token_ids)
                pair = Pair(req, by_id[eid], shared, block_size, count_tokens)
                candidates[req.request_id].append(_candidate(pair, renderer))
        index.add(req.request_id, cached_sequence(req), req.cache_salt)
        conversations.add(req.record)

    probes = {rid: [ids for c in cands for ids in c.probes]
              for rid, cands in candidates.items() if cands}
    result = replay_unbounded(to_replay(rendered), block_size, probes=probes)
    hits = result.hits

    findings: dict[str, list[Finding]] = {}
    compared: dict[str, Optional[str]] = dict(closest)
    for req, hit in zip(rendered, hits):
        cands = candidates[req.request_id]
        probe_hits = result.probe_hits.get(req.request_id, [])
        offset = 0
        for cand in cands:
            _measure(cand, hit, probe_hits[offset:offset + len(cand.probes)])
            offset += len(cand.probes)
        best = max(cands, key=lambda c: c.score, default=None)   # ties: the token-closest
        kept = [f for f in best.findings if f.tokens_lost > 0] if best else []
        findings[req.request_id] = kept
        if kept:
            compared[req.request_id] = best.earlier_id

    all_findings = [f for fs in findings.values() for f in fs]
    fixed_ids, fixed_hits, withheld = _simulate_fixes(rendered, hits, all_findings, compared,
                                                      renderer, block_size)
    reports = [RequestReport(req.request_id, req.cache_salt, len(req.token_ids), hit,
                             len(fixed_ids[req.request_id]), fixed_hits[req.request_id],
                             divergences[req.request_id], findings[req.request_id],
                             compared[req.request_id])
               for req, hit in zip(rendered, hits)]
    summaries = [RuleSummary(rule.id, rule.title, rule.fix,
                             [f for f in all_findings if f.rule == rule.id],
                             withheld.get(rule.id, [])) for rule in RULES]
    return LintReport(source, model, block_size, reports, summaries)


def _candidate(pair: Pair, renderer: Renderer) -> _Candidate:
    """Runs every rule on the pair and builds R_1..R_k (see the module docstring). With the
    findings' parts restored, the rules look again: a mistake another one covered (drifting
    whitespace behind a shuffled tool list, in a history that was also rewritten) is reported
    too. All are measured in prompt order: by the first token each one's restore changes."""
    earlier = pair.earlier.record
    found: list[tuple[int, Finding]] = []
    seen: set[tuple[str, str]] = set()
    view, record = pair, pair.current.record
    for _ in RULES:   # each pass finds a rule on a part not seen before, or stops
        new = [f for f in _checked(view) if (f.rule, f.part) not in seen]
        if not new:
            break
        for f in new:
            seen.add((f.rule, f.part))
            touch = _first_change(f, view.current, earlier, renderer)
            if view is not pair:
                f.position = _moved(f.position, view.current, pair.current)
                touch = _moved(touch, view.current, pair.current)
            found.append((touch, f))
        for f in new:
            restored = RULES_BY_ID[f.rule].restore(f, record, earlier)
            record = record if restored is None else restored
        try:
            again = renderer.render(record)
        except ValueError:   # the template refuses the restored conversation: look no further
            break
        view = Pair(again, pair.earlier, common_prefix_len(again.token_ids,
                                                           cached_sequence(pair.earlier)),
                    pair.block_size, pair.count_tokens)
    found.sort(key=lambda t: t[0])   # stable: ties keep the order they were found in
    return _chain(pair, [f for _, f in found], renderer)


def _checked(pair: Pair) -> list[Finding]:
    found = [f for f in (rule.check(pair) for rule in RULES) if f is not None]
    claimed = {label for f in found if f.rule == "whitespace-drift" for label in f.fix_data["labels"]}
    found = [f for f in found if f.rule == "whitespace-drift" or f.part not in claimed]
    return sorted(found, key=lambda f: f.position)


def _first_change(f: Finding, current: RenderedRequest, earlier: LogRecord,
                  renderer: Renderer) -> int:
    """The first token of `current` that undoing f alone changes: where f sits in the prompt,
    even when another mistake in the same part comes first."""
    restored = RULES_BY_ID[f.rule].restore(f, current.record, earlier)
    if restored is None:
        return f.position
    try:
        return common_prefix_len(current.token_ids, renderer.prompt_ids(restored))
    except ValueError:
        return f.position


def _moved(position: int, again: RenderedRequest, current: RenderedRequest) -> int:
    """A position in a restored request as the same place in the request as logged: the
    same offset into the part (span) holding it."""
    span = again.span_at(position)
    own = current.span_of(span.kind, span.message_index) if span else None
    if span is None or own is None:
        return min(position, len(current.token_ids))
    return min(own.start + position - span.start, max(own.start, own.end - 1))


def _chain(pair: Pair, found: list[Finding], renderer: Renderer) -> _Candidate:
    record, earlier = pair.current.record, pair.earlier.record
    reaches: list[_Reach] = []
    probes: list[list[int]] = []
    for f in found:
        restored = RULES_BY_ID[f.rule].restore(f, record, earlier)
        if restored is None:
            # short-prefix: the shared prefix token by token; template-rewrite: the earlier
            # conversation the template would have kept (its rule sets the reach)
            reaches.append(("shared", f.fix_data.get("reach", f.position)))
            continue
        try:
            ids = renderer.prompt_ids(restored)
        except ValueError:  # the template refuses the restored conversation: nothing to measure
            reaches.append(("none",))
            continue
        record = restored
        probes.append(ids)
        reaches.append(("probe", len(probes) - 1))
    return _Candidate(pair.earlier.request_id, found, reaches, probes)


def _measure(cand: _Candidate, hit: int, probe_hits: list[int]) -> None:
    """Sets each finding's tokens_lost and the candidate's score (the best reach)."""
    best = hit
    for f, reach in zip(cand.findings, cand.reaches):
        value = probe_hits[reach[1]] if reach[0] == "probe" else (
            reach[1] if reach[0] == "shared" else best)
        f.tokens_lost = max(0, value - best)
        best = max(best, value)
    cand.score = best


def _simulate_fixes(rendered: list[RenderedRequest], hits: list[int], findings: list[Finding],
                    compared: dict[str, Optional[str]], renderer: Renderer, block_size: int,
                    ) -> tuple[dict[str, list[int]], dict[str, int], dict[str, list]]:
    """Per salt: the requests rewritten with the fixes kept, their hits, and per rule the salts
    whose fix was withheld. Salts never share blocks, so each is replayed on its own."""
    fixed_ids = {r.request_id: r.token_ids for r in rendered}
    fixed_hits = {r.request_id: h for r, h in zip(rendered, hits)}
    withheld: dict[str, list] = {}
    groups: dict[Optional[str], list[int]] = {}
    for i, r in enumerate(rendered):
        groups.setdefault(r.cache_salt, []).append(i)
    salt_of = {r.request_id: r.cache_salt for r in rendered}
    for salt, members in groups.items():
        fired = [f for f in findings if salt_of[f.request_id] == salt and f.rule in SIMULATED_RULES]
        if not fired:
            continue
        records = [rendered[i].record for i in members]
        outputs = [rendered[i].output_token_ids for i in members]   # fixes leave replies alone
        runs: dict[frozenset, tuple[list[ReplayRequest], list[int]]] = {
            frozenset(): (to_replay([rendered[i] for i in members]), [hits[i] for i in members])}

        def run(rules: frozenset) -> tuple[list[ReplayRequest], list[int]]:
            if rules not in runs:
                fixed = apply_fixes(records, [f for f in fired if f.rule in rules], compared)
                requests = [ReplayRequest(r.request_id, renderer.prompt_ids(r), r.cache_salt, out)
                            for r, out in zip(fixed, outputs)]
                runs[rules] = (requests, replay_unbounded(requests, block_size).hits)
            return runs[rules]

        kept = frozenset(f.rule for f in fired)
        best = sum(run(kept)[1])
        while kept:
            # Withdraw the fix whose removal gains most while one does; the empty set is
            # among the trials, so the end is never below the log as it was.
            gain, rule = max((sum(run(kept - {r})[1]), r) for r in sorted(kept))
            if gain <= best:
                break
            kept, best = kept - {rule}, gain
        for rule in sorted({f.rule for f in fired} - kept):
            withheld.setdefault(rule, []).append(salt)
        requests, salt_hits = run(kept)
        for req, h in zip(requests, salt_hits):
            fixed_ids[req.request_id] = list(req.token_ids)
            fixed_hits[req.request_id] = h
    return fixed_ids, fixed_hits, withheld


def _earlier_part(earlier: RenderedRequest, position: int) -> str:
    if position >= len(cached_sequence(earlier)):
        return "end of the earlier request"
    if position >= len(earlier.token_ids):
        return "its generated reply"
    span = earlier.span_at(position)
    return span.label if span else "?"
