"""Each rule fires on a log written to show its pattern and stays silent on a clean log."""
from __future__ import annotations

import pytest

from prefixserve.diagnose import lint, load_renderer, read_log
from prefixserve.diagnose.rules import RULE_IDS
from diagnose_logs import RULE_LOGS, RULE_MODELS, clean_log, write_log


@pytest.fixture(scope="module")
def renderers():
    return {model: load_renderer(model) for model in {"random:qwen3-tiny", *RULE_MODELS.values()}}


@pytest.fixture(scope="module")
def renderer(renderers):
    return renderers["random:qwen3-tiny"]


def run(tmp_path, renderer, records):
    return lint(read_log(write_log(tmp_path / "log.jsonl", records)), renderer, block_size=16)


def test_every_rule_has_a_log():
    assert set(RULE_LOGS) == set(RULE_IDS)


def test_clean_log_fires_nothing(tmp_path, renderer):
    report = run(tmp_path, renderer, clean_log())
    assert report.fired() == []
    assert report.reusable_tokens > 0
    # Nothing to fix: the rewritten log is the same log.
    assert report.fixed_tokens == report.tokens
    assert report.fixed_reusable_tokens == report.reusable_tokens


@pytest.mark.parametrize("rule", RULE_IDS)
def test_rule_fires_on_its_pattern_only(tmp_path, renderers, rule):
    report = run(tmp_path, renderers[RULE_MODELS.get(rule, "random:qwen3-tiny")], RULE_LOGS[rule]())
    assert report.fired() == [rule]
    summary = next(s for s in report.rules if s.rule == rule)
    assert summary.requests, rule
    for finding in summary.findings:
        assert finding.compared_to != finding.request_id
        req = next(r for r in report.requests if r.request_id == finding.request_id)
        assert 0 <= finding.position <= req.tokens
    if rule == "short-prefix":
        # Only whole blocks are reused: the shared preamble is below one block, nothing hits.
        assert all(0 < f.tokens_lost < 16 for f in summary.findings)
        assert all(r.reusable_tokens == 0 for r in report.requests if r.request_id in summary.requests)
    elif rule == "changed-image":
        # The picture is the request's content: no rewrite of the log sends another one.
        assert report.fixed_reusable_tokens == report.reusable_tokens
        assert summary.tokens_lost > 0
    else:
        # The suggested fix recovers reuse the log lost, and the loss is credited to the rule.
        assert report.fixed_hit_rate > report.hit_rate
        assert summary.tokens_lost > 0


def test_dynamic_system_names_the_values(tmp_path, renderer):
    report = run(tmp_path, renderer, RULE_LOGS["dynamic-system"]())
    details = " ".join(f.detail for s in report.rules for f in s.findings)
    assert "date" in details and "2025-01-04" in details
    assert "Bob" in details


def test_tool_order_tells_reorder_from_rekey(tmp_path, renderer):
    report = run(tmp_path, renderer, RULE_LOGS["tool-order"]())
    details = [f.detail for s in report.rules for f in s.findings]
    assert any("order changed" in d for d in details)
    assert any("key order" in d for d in details)


def test_salts_are_never_compared(tmp_path, renderer):
    records = RULE_LOGS["tool-order"]()
    for i, r in enumerate(records):
        r["tenant"] = f"tenant-{i}"
    report = run(tmp_path, renderer, records)
    assert report.fired() == []
    assert report.reusable_tokens == 0
    assert all(r.divergence is None for r in report.requests)
