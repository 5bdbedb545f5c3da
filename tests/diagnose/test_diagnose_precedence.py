"""A part whose earlier and current texts differ only in whitespace is whitespace-drift's,
whatever else its change resembles (a rewritten message, re-serialised tools, changed lines);
a real change elsewhere in the same request is still reported as its own rule. Tokens lost are
checked against the engine's kv code driven directly (tests/cache_reuse_oracle.py Engine)."""
from __future__ import annotations

import json
import random

import pytest

from prefixserve.diagnose import lint, load_renderer, read_log
from diagnose_logs import STABLE, TOOLS, assistant, chat, question, sys, user, write_log
from cache_reuse_oracle import SALT, Engine


@pytest.fixture(scope="module")
def renderer():
    return load_renderer("random:qwen3-tiny")


def replied(record: dict, reply: str) -> dict:
    return {**record, "tenant": SALT,
            "response": {"choices": [{"message": {"role": "assistant", "content": reply}}]}}


def run(tmp_path, renderer, records):
    return lint(read_log(write_log(tmp_path / "log.jsonl", records)), renderer, block_size=16)


def test_reply_rewrapped_in_history_is_whitespace_drift(tmp_path, renderer):
    """The client stores each reply with its blank line collapsed: the history is not edited
    content, and what it costs is the reply's cached tokens and everything after them."""
    rng = random.Random(1)
    msgs, records, replies = [sys(STABLE)], [], []
    for _ in range(5):
        msgs.append(user(question(rng)))
        reply = f"{question(rng)}\n\n{question(rng)}"
        records.append(replied(chat(list(msgs), tools=TOOLS), reply))
        replies.append(reply)
        msgs.append(assistant(reply.replace("\n\n", "\n")))
    report = run(tmp_path, renderer, records)
    assert report.fired() == ["whitespace-drift"]
    findings = report.rules[[s.rule for s in report.rules].index("whitespace-drift")].findings
    assert [f.part for f in findings] == [f"history message {2 * i} (assistant)" for i in range(1, 5)]

    engine, expected = Engine(renderer.tokenizer), []
    for i, r in enumerate(records):
        body = r["body"]
        ids = engine.tokens(body["messages"], body["tools"])
        if i:
            kept = body["messages"][:-2] + [assistant(replies[i - 1]), body["messages"][-1]]
            expected.append(engine.reuse(engine.tokens(kept, body["tools"])) - engine.reuse(ids))
        engine.serve(ids, replies[i])
    assert [f.tokens_lost for f in findings] == expected and min(expected) > 0
    assert report.fixed_reusable_tokens > report.reusable_tokens


def test_tools_differing_only_in_whitespace_are_not_tool_order(tmp_path, renderer):
    rng = random.Random(2)
    spaced = json.loads(json.dumps(TOOLS).replace("Call ", "Call  "))
    records = [chat([sys(STABLE), user(question(rng))], tools=t, tenant=SALT)
               for t in (TOOLS, spaced)]
    report = run(tmp_path, renderer, records)
    assert report.fired() == ["whitespace-drift"]
    (finding,) = report.rules[[s.rule for s in report.rules].index("whitespace-drift")].findings
    assert finding.part == "tools" and finding.tokens_lost > 0


def test_whitespace_drift_and_a_real_rewrite_in_one_request_are_both_reported(tmp_path, renderer):
    """System prompt separators drift and an old message is replaced by a summary: the first
    is whitespace-drift, the second history-rewrite, each with the tokens it alone costs."""
    rng = random.Random(3)
    u1, a1, u2, a2, u3 = (question(rng) for _ in range(5))
    drifted = STABLE.replace("\n", "\n\n")
    records = [replied(chat([sys(STABLE), user(u1)]), a1),
               replied(chat([sys(STABLE), user(u1), assistant(a1), user(u2)]), a2),
               chat([sys(drifted), user("Summary: the user asked about printers."), user(u2),
                     assistant(a2), user(u3)], tenant=SALT)]
    report = run(tmp_path, renderer, records)
    assert sorted(report.fired()) == ["history-rewrite", "whitespace-drift"]
    last = report.requests[-1]
    assert [f.rule for f in last.findings] == ["whitespace-drift", "history-rewrite"]

    engine = Engine(renderer.tokenizer)
    for r, reply in zip(records[:2], (a1, a2)):
        engine.serve(engine.tokens(r["body"]["messages"], None), reply)
    as_sent = engine.reuse(engine.tokens(records[2]["body"]["messages"], None))
    system_fixed = engine.reuse(engine.tokens([sys(STABLE)] + records[2]["body"]["messages"][1:],
                                              None))
    appended = engine.reuse(engine.tokens(
        records[1]["body"]["messages"] + [assistant(a2), user(u3)], None))
    assert [f.tokens_lost for f in last.findings] == [system_fixed - as_sent,
                                                      appended - system_fixed]
    assert min(f.tokens_lost for f in last.findings) > 0
