"""The four mistakes of docs/prompt-caching-guide.md in their textbook forms, each a realistic
log of several hundred chat requests (a long system prompt, five tools, interleaved
conversations whose histories grow turn by turn, logged replies), and logs mixing two of them.

The oracles do not use the lint: prompts are rendered with the tokenizer's chat template,
reuse is counted by driving prefixserve.kv (the engine's own block hashing) one request at a
time, and each mistake is undone from the generator's own knowledge of the conversation (the
request's previous turn, what it sent before rewriting it), never from the comparison the lint
chose. Two independent counts: the reuse of the whole log written without the mistake against
the log as written, and per request the reuse it would have had with the mistake undone.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Callable, Optional

import pytest

from prefixserve.diagnose import lint, load_renderer, read_log
from prefixserve.diagnose.fixes import apply_fixes
from prefixserve.diagnose.lint_report import format_lint
from cache_reuse_oracle import BLOCK, SALT, Engine
from diagnose_logs import write_log
from textbook_parts import OPENERS, TOOLS, sentence

REQUESTS = 300


@dataclass
class Sent:
    """One logged request and what the generator knows about it."""
    previous: Optional[int]     # index of the same conversation's previous request
    messages: list[dict]        # as sent, system prompt first
    tools: list[dict]
    transcript: list[dict]      # the conversation never rewritten, ending with the new question
    rewritten: bool
    reply: str


def make_log(mistakes: set[str], seed: int = 0, n: int = REQUESTS,
             drift: str = "requests") -> list[Sent]:
    """mistakes: timestamp (the current time in the system prompt), rewrite (everything but the
    last exchange re-summarised every turn), shuffle (tools in a new order every request),
    whitespace (sentence separators "\\n" or "\\n\\n": alternating request by request with
    drift="requests", drawn per separator with drift="separators"). The same seed writes the
    same conversations with or without the mistakes: those draw from their own generator."""
    content, noise = random.Random(seed), random.Random(seed + 1)
    sentences = [sentence(content, 10, 18) for _ in range(22)]
    openers = list(OPENERS)
    content.shuffle(openers)
    first_stamp: Optional[int] = None
    log: list[Sent] = []
    active: list[dict] = []
    while len(log) < n:
        if len(active) < 4 or content.random() < 0.15:
            active.append({"turns": content.randint(3, 8), "transcript": [], "last": None,
                           "opener": openers.pop()})
        conv = content.choice(active)
        k = len(conv["transcript"]) // 2 + 1
        question = f"{sentence(content)} {sentence(content)}"
        if k == 1:  # every conversation opens with a token of its own
            question = f"{conv['opener']}, {question[0].lower()}{question[1:]}"
        transcript = conv["transcript"] + [{"role": "user", "content": question}]
        reply = " ".join(sentence(content, 10, 20) for _ in range(content.randint(1, 3)))

        stamp = 1_750_000_000 + noise.randint(0, 86_400 * 28)
        order = list(range(len(TOOLS)))
        noise.shuffle(order)
        drawn = [noise.choice(["\n", "\n\n"]) for _ in sentences[1:]]
        first_stamp = stamp if first_stamp is None else first_stamp
        if "timestamp" not in mistakes:
            stamp = first_stamp
        if "whitespace" not in mistakes:
            seps = ["\n"] * len(drawn)
        elif drift == "requests":
            seps = [("\n", "\n\n")[len(log) % 2]] * len(drawn)
        else:
            seps = drawn
        clock = (f"2025-06-{1 + stamp // 86_400 % 28:02d} {stamp // 3600 % 24:02d}:"
                 f"{stamp // 60 % 60:02d}:{stamp % 60:02d}")
        system = (f"You are the support agent of Acme Cloud. Current time: {clock} UTC.\n"
                  + sentences[0] + "".join(s + t for s, t in zip(seps, sentences[1:])))
        tools = [TOOLS[j] for j in order] if "shuffle" in mistakes else TOOLS
        rewritten = "rewrite" in mistakes and k >= 3
        sent = [summary(transcript, k)] + transcript[-3:] if rewritten else transcript
        log.append(Sent(conv["last"], [{"role": "system", "content": system}] + sent, tools,
                        transcript, rewritten, reply))
        conv["transcript"] = transcript + [{"role": "assistant", "content": reply}]
        conv["last"] = len(log) - 1
        if k >= conv["turns"]:
            active.remove(conv)
    return log


def summary(transcript: list[dict], k: int) -> dict:
    asked = " ".join("The user asked about " + " ".join(m["content"].split()[1:5]) + "."
                     for m in transcript[:-3:2])
    return {"role": "user", "content": f"Summary of turns 1 to {k - 2}: {asked}"}


def records(log: list[Sent]) -> list[dict]:
    return [{"request_id": f"req-{i:04d}", "timestamp": 1_750_000_000 + i, "tenant": SALT,
             "body": {"model": "m", "messages": s.messages, "tools": s.tools},
             "response": {"choices": [{"index": 0, "finish_reason": "stop",
                                       "message": {"role": "assistant", "content": s.reply}}]}}
            for i, s in enumerate(log)]


# --------------------------------------------------------------------------- the oracle


@pytest.fixture(scope="module")
def renderer():
    return load_renderer("random:qwen3-tiny")




def engine_reuse(tokenizer, log: list[Sent]) -> int:
    engine = Engine(tokenizer)
    return sum(engine.serve(engine.tokens(s.messages, s.tools), s.reply) for s in log)


State = tuple[list[dict], list[dict]]   # (messages, tools)
Undo = Callable[[list[Sent], int, int, State], State]


def undo_system(log: list[Sent], i: int, p: int, state: State) -> State:
    return [log[p].messages[0]] + state[0][1:], state[1]


def undo_tools(log: list[Sent], i: int, p: int, state: State) -> State:
    return state[0], log[p].tools


def undo_rewrite(log: list[Sent], i: int, p: int, state: State) -> State:
    if not log[i].rewritten:
        return state
    kept = log[p].messages + [{"role": "assistant", "content": log[p].reply}]
    return [state[0][0]] + kept[1:] + log[i].transcript[-1:], state[1]


def undone_gains(tokenizer, log: list[Sent], undo: list[Undo]) -> tuple[int, list[dict[int, int]]]:
    """The log's reuse as written and, per undo step, per request: the tokens the engine would
    have reused for it with the mistakes up to that step undone against its previous turn (the
    request logged just before it, for a first turn), beyond its best reuse with fewer undone."""
    engine = Engine(tokenizer)
    gains: list[dict[int, int]] = [{} for _ in undo]
    logged = 0
    for i, s in enumerate(log):
        ids = engine.tokens(s.messages, s.tools)
        best = engine.reuse(ids)
        p = s.previous if s.previous is not None else i - 1
        state: State = (s.messages, s.tools)
        for k, step in enumerate(undo):
            if p < 0:
                break
            state = step(log, i, p, state)
            reach = engine.reuse(engine.tokens(*state))
            if reach > best:
                gains[k][i] = reach - best
                best = reach
        logged += engine.serve(ids, s.reply)
    return logged, gains


# --------------------------------------------------------------------------- the tests


def run_lint(tmp_path, renderer, log: list[Sent]):
    records_ = read_log(write_log(tmp_path / "log.jsonl", records(log)))
    return records_, lint(records_, renderer, block_size=BLOCK)


def lost_by_request(report, rule: str) -> dict[int, int]:
    return {int(f.request_id.split("-")[1]): f.tokens_lost
            for s in report.rules if s.rule == rule for f in s.findings}


TEXTBOOK = [  # (mistake, generator form, rule, how to undo it)
    ("timestamp", "requests", "dynamic-system", undo_system),
    ("rewrite", "requests", "history-rewrite", undo_rewrite),
    ("shuffle", "requests", "tool-order", undo_tools),
    ("whitespace", "requests", "whitespace-drift", undo_system),
    ("whitespace", "separators", "whitespace-drift", undo_system),
]


@pytest.mark.slow
@pytest.mark.parametrize("mistake, drift, rule, undo", TEXTBOOK,
                         ids=[f"{m}-{d}" for m, d, _, _ in TEXTBOOK])
def test_textbook_mistake_is_its_rule_with_the_tokens_it_loses(tmp_path, renderer, mistake,
                                                              drift, rule, undo):
    log = make_log({mistake}, drift=drift)
    _, report = run_lint(tmp_path, renderer, log)
    tok = renderer.tokenizer
    logged, (gains,) = undone_gains(tok, log, [undo])
    assert report.reusable_tokens == logged
    assert report.fired() == [rule]
    summary_ = next(s for s in report.rules if s.rule == rule)
    assert all(f.tokens_lost > 0 for f in summary_.findings)
    # Per request, exactly what undoing the mistake against its own previous turn gives.
    assert lost_by_request(report, rule) == gains
    if mistake != "rewrite":
        # And in all: the log written without the mistake against the log as written (a
        # rewritten history is shorter than the append-only one, so there the two differ).
        clean = make_log(set(), drift=drift)
        assert summary_.tokens_lost == engine_reuse(tok, clean) - logged > 0
    assert report.fixed_reusable_tokens > report.reusable_tokens
    if mistake == "whitespace":
        # Issue 18: "\n" against "\n\n" between sentences is neither volatile content nor a
        # rewrite, and the printed report says so.
        assert {f.part for f in summary_.findings} == {"system prompt"}
        text = format_lint(report)
        printed = [int(re.search(pattern, text).group(1)) for pattern in (
            r"reusable as logged +(\d+)", r"reusable after suggested fixes (\d+)",
            r"rules fired: whitespace-drift \(\d+ requests, (\d+) tokens lost\)\n")]
        assert printed == [report.reusable_tokens, report.fixed_reusable_tokens,
                           summary_.tokens_lost]


MIXED = [  # (mistakes, rules in prompt order, undo steps in that order, split checked for)
    ({"whitespace", "shuffle"}, ["whitespace-drift", "tool-order"], [undo_system, undo_tools],
     "later turns"),
    ({"timestamp", "rewrite"}, ["dynamic-system", "history-rewrite"], [undo_system, undo_rewrite],
     "every request"),
]


@pytest.mark.slow
@pytest.mark.parametrize("mistakes, rules, undo, split", MIXED,
                         ids=["+".join(sorted(m)) for m, _, _, _ in MIXED])
def test_two_mistakes_each_with_its_own_loss_and_monotone_fixes(tmp_path, renderer, mistakes,
                                                                rules, undo, split):
    log = make_log(mistakes)
    records_, report = run_lint(tmp_path, renderer, log)
    tok = renderer.tokenizer
    assert sorted(report.fired()) == sorted(rules)
    logged, gains = undone_gains(tok, log, undo)
    lost = [lost_by_request(report, rule) for rule in rules]
    for rule, by_request in zip(rules, lost):
        assert sum(by_request.values()) > 0, rule
        assert all(v > 0 for v in by_request.values()), rule
    # Together they lose what undoing both gives back, request by request.
    together = [sum(x.get(i, 0) for x in lost) for i in range(len(log))]
    assert together == [sum(g.get(i, 0) for g in gains) for i in range(len(log))]
    # Each its own share. A first turn has no previous turn of its own: with two mistakes, which
    # earlier request both are undone against decides the split, so there only the sum is fixed.
    checked = [i for i in range(len(log)) if split == "every request" or log[i].previous is not None]
    for by_request, gain in zip(lost, gains):
        assert [by_request.get(i, 0) for i in checked] == [gain.get(i, 0) for i in checked]

    # Fixes: each raises the predicted reuse alone and on top of the other.
    closest = {r.request_id: r.compared_to for r in report.requests}
    findings = [f for s in report.rules for f in s.findings]

    def reuse_with(fixed_rules: set[str]) -> int:
        fixed = apply_fixes(records_, [f for f in findings if f.rule in fixed_rules], closest)
        engine = Engine(tok)
        return sum(engine.serve(engine.tokens(r.messages, r.tools), r.output_text) for r in fixed)

    a, b = rules
    only_a, only_b, both = (reuse_with(s) for s in ({a}, {b}, {a, b}))
    assert logged == report.reusable_tokens
    assert logged < only_a <= both and logged < only_b <= both
    assert both == report.fixed_reusable_tokens


def test_a_fix_that_would_lower_reuse_is_not_proposed(tmp_path, renderer, monkeypatch):
    """A log with drifting whitespace whose tools come reversed in three requests, and a
    tool-order "fix" that shuffles the tools of every request: replayed, it loses reuse, so the
    lint withdraws it and says so, while the whitespace fix stays."""
    shuffler = random.Random(5)

    def reshuffle(tools):
        tools = list(tools)
        shuffler.shuffle(tools)
        return tools

    monkeypatch.setattr("prefixserve.diagnose.fixes.canonical_tools", reshuffle)
    log = make_log({"whitespace"}, n=120)
    for i in (10, 40, 70):
        log[i].tools = TOOLS[::-1]
    _, report = run_lint(tmp_path, renderer, log)
    summary_ = {s.rule: s for s in report.rules}
    assert summary_["tool-order"].findings and summary_["tool-order"].fix_withheld == [SALT]
    assert summary_["whitespace-drift"].fix_withheld == []
    assert report.fixed_reusable_tokens > report.reusable_tokens
    text = format_lint(report)
    assert "not proposed: replayed with this fix" in text
    # With only the whitespace fix kept, after-fixes is what that fix alone predicts.
    records_ = read_log(tmp_path / "log.jsonl")
    closest = {r.request_id: r.compared_to for r in report.requests}
    fixed = apply_fixes(records_, summary_["whitespace-drift"].findings, closest)
    engine = Engine(renderer.tokenizer)
    assert report.fixed_reusable_tokens == sum(
        engine.serve(engine.tokens(r.messages, r.tools), r.output_text) for r in fixed)
