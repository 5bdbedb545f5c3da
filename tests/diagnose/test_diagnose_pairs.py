"""Every pair of the four textbook mistakes in one log, and each mistake sharing a part with
whitespace drift (the system prompt with a timestamp, the tools with a shuffle, the history
with a rewrite): the lint reports both, each with the tokens it alone loses, and "after fixes"
is what all the fixes together give.

The oracle does not use the lint. The generator knows what each request would have been with
each mistake undone against its previous turn (the request logged just before it, for a first
turn), renders it with the tokenizer's chat template and counts the tokens the engine's kv code
would reuse for it. Prompt order is where undoing a mistake alone first changes the token ids.
"After fixes" is the log the generator writes with the documented fixes applied
(docs/prompt-caching-guide.md, fixes.py's docstring), replayed the same way.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from typing import Optional

import pytest

from prefixserve.diagnose import lint, load_renderer, read_log
from prefixserve.diagnose.rules import canonical_tools
from prefixserve.prompt import common_prefix_len
from cache_reuse_oracle import BLOCK, SALT, Engine
from diagnose_logs import write_log
from textbook_parts import OPENERS, TOOLS, sentence

REQUESTS = 120
RULE = {"timestamp": "dynamic-system", "rewrite": "history-rewrite", "shuffle": "tool-order",
        "whitespace": "whitespace-drift"}


@dataclass
class Turn:
    previous: Optional[int]
    earlier: list[int]      # the conversation's earlier requests, oldest first
    question: str
    reply: str
    clock: str              # the time a client with the timestamp mistake writes
    order: tuple[int, ...]  # the tool order a shuffling client sends


def conversations(seed: int = 0, n: int = REQUESTS) -> tuple[list[str], list[Turn]]:
    content, noise = random.Random(seed), random.Random(seed + 1)
    sentences = [sentence(content, 10, 18) for _ in range(22)]
    openers = list(OPENERS)
    content.shuffle(openers)
    turns: list[Turn] = []
    active: list[dict] = []
    while len(turns) < n:
        if len(active) < 4 or content.random() < 0.15:
            active.append({"turns": content.randint(3, 8), "earlier": [], "opener": openers.pop()})
        conv = content.choice(active)
        question = f"{sentence(content)} {sentence(content)}"
        if not conv["earlier"]:
            question = f"{conv['opener']}, {question[0].lower()}{question[1:]}"
        reply = " ".join(sentence(content, 10, 20) for _ in range(content.randint(1, 3)))
        stamp = noise.randint(0, 86_400 * 28)
        clock = (f"2025-06-{1 + stamp // 86_400:02d} {stamp // 3600 % 24:02d}:"
                 f"{stamp // 60 % 60:02d}:{stamp % 60:02d}")
        order = list(range(len(TOOLS)))
        noise.shuffle(order)
        earlier = list(conv["earlier"])
        turns.append(Turn(earlier[-1] if earlier else None, earlier, question, reply, clock,
                          tuple(order)))
        conv["earlier"].append(len(turns) - 1)
        if len(conv["earlier"]) >= conv["turns"]:
            active.remove(conv)
    return sentences, turns


@dataclass(frozen=True)
class Req:
    """One request as the client builds it: each field one choice a mistake can spoil."""
    clock: str                  # "" for the placeholder of the dynamic-system fix
    sep: str                    # between the system prompt's sentences
    order: tuple[int, ...]
    space: str                  # between the first two words of every tool description
    history: tuple[str, ...]    # JSON of the messages between the system prompt and the question
    question: str


def wrapped(reply: str) -> str:
    """The reply as a client that re-wraps it sends it back: one sentence a line."""
    return reply.replace(". ", ".\n")


def summary(questions: list[str]) -> dict:
    asked = " ".join("The user asked about " + " ".join(q.split()[1:5]) + "." for q in questions)
    return {"role": "user", "content": f"Summary of turns 1 to {len(questions)}: {asked}"}


class Client:
    """Writes the log: with the mistakes named, where whitespace drifts (system, tools or
    history) and, when fixed, as the documented fixes rewrite it."""

    def __init__(self, sentences: list[str], turns: list[Turn], mistakes: set[str],
                 where: str = "system", fixed: frozenset = frozenset()) -> None:
        self.sentences, self.turns, self.where, self.fixed = sentences, turns, where, fixed
        self.on = {m for m in mistakes if m not in fixed}
        self.mistakes = mistakes
        self.reqs: list[Req] = []
        for i in range(len(turns)):
            self.reqs.append(self._req(i))

    def drifts(self, part: str) -> bool:
        return "whitespace" in self.on and self.where == part

    def question_sent(self, i: int) -> str:
        q = self.turns[i].question
        if "timestamp" in self.mistakes and "timestamp" in self.fixed:
            # the dynamic-system fix: the request's own values open its last message
            date, time = self.turns[i].clock.split()
            return f"Context: {date} | {time}\n\n{q}"
        return q

    def reply_sent(self, i: int) -> str:
        return wrapped(self.turns[i].reply) if self.drifts("history") else self.turns[i].reply

    def _req(self, i: int) -> Req:
        t = self.turns[i]
        variant = i % 2   # a drifting client alternates request by request; request 0 sends 0
        clock = t.clock if "timestamp" in self.on else (
            "" if "timestamp" in self.mistakes else self.turns[0].clock)
        history: list[dict] = []
        for j in t.earlier:
            history += [{"role": "user", "content": self.question_sent(j)},
                        {"role": "assistant", "content": self.reply_sent(j)}]
        if "rewrite" in self.on and len(t.earlier) >= 2:
            history = [summary([self.turns[j].question for j in t.earlier[:-1]])] + history[-2:]
        return Req(clock, ("\n", "\n\n")[variant] if self.drifts("system") else "\n",
                   t.order if "shuffle" in self.on else tuple(range(len(TOOLS))),
                   (" ", "  ")[variant] if self.drifts("tools") else " ",
                   tuple(json.dumps(m) for m in history), self.question_sent(i))

    def build(self, req: Req) -> tuple[list[dict], list[dict]]:
        clock = req.clock or "[see context]"
        system = (f"You are the support agent of Acme Cloud. Current time: {clock} UTC.\n"
                  + req.sep.join(self.sentences))
        tools = [json.loads(json.dumps(TOOLS[j]).replace("Read a file", "Read" + req.space + "a file")
                            .replace("Run the test", "Run" + req.space + "the test"))
                 for j in req.order]
        if "shuffle" in self.fixed:
            tools = canonical_tools(tools)
        messages = ([{"role": "system", "content": system}] + [json.loads(m) for m in req.history]
                    + [{"role": "user", "content": req.question}])
        return messages, tools

    def undo(self, mistake: str, i: int, p: int, req: Req) -> Req:
        """req (request i, maybe with other mistakes undone) with `mistake` undone against p."""
        prev = self.reqs[p]
        if mistake == "timestamp":
            return replace(req, clock=prev.clock)
        if mistake == "shuffle":
            return replace(req, order=prev.order)
        if mistake == "rewrite":
            if len(self.turns[i].earlier) < 2:
                return req
            kept = prev.history + (json.dumps({"role": "user", "content": prev.question}),
                                   json.dumps({"role": "assistant", "content": self.reply_sent(p)}))
            return replace(req, history=kept)
        if self.where == "system":
            return replace(req, sep=prev.sep)
        if self.where == "tools":
            return replace(req, space=prev.space)
        logged = json.dumps({"role": "assistant", "content": self.reply_sent(p)})
        verbatim = json.dumps({"role": "assistant", "content": self.turns[p].reply})
        return replace(req, history=tuple(verbatim if m == logged else m for m in req.history))

    def records(self) -> list[dict]:
        out = []
        for i, req in enumerate(self.reqs):
            messages, tools = self.build(req)
            out.append({"request_id": f"req-{i:04d}", "timestamp": 1_750_000_000 + i,
                        "tenant": SALT, "body": {"model": "m", "messages": messages, "tools": tools},
                        "response": {"choices": [{"index": 0, "finish_reason": "stop", "message": {
                            "role": "assistant", "content": self.turns[i].reply}}]}})
        return out

    def reuse(self, tokenizer) -> int:
        engine = Engine(tokenizer)
        return sum(engine.serve(engine.tokens(*self.build(r)), t.reply)
                   for r, t in zip(self.reqs, self.turns))


def oracle_losses(client: Client, tokenizer, a: str, b: str) -> tuple[int, dict, dict, dict]:
    """The log's reuse as written; per request, each mistake's loss in prompt order (against
    its previous turn) and, apart, the two together."""
    engine = Engine(tokenizer)
    lost: dict[str, dict[int, int]] = {a: {}, b: {}}
    together: dict[int, int] = {}
    logged = 0
    for i, (req, turn) in enumerate(zip(client.reqs, client.turns)):
        ids = engine.tokens(*client.build(req))
        p = turn.previous if turn.previous is not None else i - 1
        if p >= 0:
            base = engine.reuse(ids)
            alone = {m: engine.tokens(*client.build(client.undo(m, i, p, req))) for m in (a, b)}
            both = engine.reuse(engine.tokens(*client.build(
                client.undo(b, i, p, client.undo(a, i, p, req)))))
            first, second = sorted((a, b), key=lambda m: common_prefix_len(ids, alone[m]))
            reach_first = engine.reuse(alone[first])
            for m, gain in ((first, reach_first - base), (second, both - max(base, reach_first))):
                if gain > 0:
                    lost[m][i] = gain
            if both > base:
                together[i] = both - base
        logged += engine.serve(ids, turn.reply)
    return logged, lost[a], lost[b], together


PAIRS = [  # (mistakes, where whitespace drifts)
    (("timestamp", "rewrite"), "system"),
    (("timestamp", "shuffle"), "system"),
    (("timestamp", "whitespace"), "system"),      # one part: the system prompt
    (("rewrite", "shuffle"), "system"),
    (("rewrite", "whitespace"), "system"),
    (("shuffle", "whitespace"), "system"),
    (("shuffle", "whitespace"), "tools"),         # one part: the tools
    (("rewrite", "whitespace"), "history"),       # one part: the history
]


@pytest.fixture(scope="module")
def renderer():
    return load_renderer("random:qwen3-tiny")


@pytest.fixture(scope="module")
def log():
    return conversations()


@pytest.mark.slow
@pytest.mark.parametrize("pair, where", PAIRS, ids=[f"{a}+{b}-{w}" for (a, b), w in PAIRS])
def test_both_mistakes_reported_each_with_its_own_loss(tmp_path, renderer, log, pair, where):
    a, b = pair
    client = Client(*log, set(pair), where)
    report = lint(read_log(write_log(tmp_path / "log.jsonl", client.records())), renderer,
                  block_size=BLOCK)
    tok = renderer.tokenizer
    assert sorted(report.fired()) == sorted({RULE[a], RULE[b]})

    logged, lost_a, lost_b, together = oracle_losses(client, tok, a, b)
    assert report.reusable_tokens == logged
    by_rule = {s.rule: {int(f.request_id.split("-")[1]): f.tokens_lost for f in s.findings}
               for s in report.rules if s.findings}
    assert min(min(v.values()) for v in by_rule.values()) > 0
    # Request by request, the two together lose what undoing both gives back.
    assert {i: by_rule[RULE[a]].get(i, 0) + by_rule[RULE[b]].get(i, 0)
            for i in together} == together
    assert set(by_rule[RULE[a]]) | set(by_rule[RULE[b]]) == set(together)
    # Each its own share, where the request has a previous turn of its own (a first turn is
    # compared with whichever earlier request explains most, as the lint documents).
    own = [i for i, t in enumerate(client.turns) if t.previous is not None]
    for m, oracle in ((a, lost_a), (b, lost_b)):
        assert sum(oracle.values()) > 0, m
        assert [by_rule[RULE[m]].get(i, 0) for i in own] == [oracle.get(i, 0) for i in own], m

    # After fixes: the log written with both documented fixes, replayed.
    fixed = Client(*log, set(pair), where, fixed=frozenset(pair)).reuse(tok)
    assert report.fixed_reusable_tokens == fixed > logged
