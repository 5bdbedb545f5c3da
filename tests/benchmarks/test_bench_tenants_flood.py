"""The tenants-flood workload's bookkeeping (the run itself starts servers: docs/benchmarks.md
keeps one): per-tenant figures from request records, medians over repeats, its CLI entry."""
from __future__ import annotations

import argparse

import pytest

from prefixserve.benchmarks import cli
from prefixserve.benchmarks.tenants_flood import (FloodConfig, Record, _median_of, _summary, _ttft_targets,
                                                 engine_steps_run,
                                                 to_markdown)


def test_summary_counts_each_tenant_apart():
    records = [Record("quiet", 200, 0.010, [0.002, 0.004], 100, 90, 2),
               Record("quiet", 200, 0.030, [0.003], 100, 80, 2),
               Record("quiet", 429),
               Record("flood", 200, 0.200, [], 50, 0, 2),
               Record("flood", 500)]
    s = _summary("x", records, wall_s=2.0)
    q, f = s["quiet"], s["flood"]
    assert (q["sent"], q["done"], q["refused"], q["other_errors"]) == (3, 2, 1, 0)
    assert q["hit_rate"] == pytest.approx(170 / 200)
    assert q["ttft_p50_ms"] in (10.0, 30.0) and q["ttft_p99_ms"] == pytest.approx(30.0)
    assert q["gap_p50_ms"] == pytest.approx(3.0)
    assert q["served_tok_per_s"] == pytest.approx((200 + 4) / 2.0)
    assert (f["done"], f["other_errors"], f["served_tok_per_s"]) == (1, 1, pytest.approx(26.0))


def test_median_of_repeats_is_taken_field_by_field():
    runs = [{"run": "a", "x": 1.0, "t": {"y": 5}}, {"run": "a", "x": 9.0, "t": {"y": 1}},
            {"run": "a", "x": 3.0, "t": {"y": 2}}]
    assert _median_of(runs) == {"run": "a", "x": 3.0, "t": {"y": 2}}


def test_the_bench_cli_runs_it_only_on_its_own():
    args = argparse.Namespace(workload=["tenants-flood", "system-prompt"], online=None)
    with pytest.raises(ValueError, match="on its own"):
        cli.run(args)


@pytest.mark.parametrize("quiet", ["sends", "idle", "absent"])
def test_engine_steps_serve_every_flood_token_and_time_only_a_quiet_that_sends(quiet):
    cfg = FloodConfig(quiet_system_tokens=64, flood_prompt_tokens=40, question_tokens=4, max_tokens=2)
    r = engine_steps_run(cfg, "on", steps=6, quiet_every=3, quiet=quiet)
    assert r["flood_tokens"] == 6 * (40 + 2)
    if quiet == "sends":
        assert r["run"] == "on" and r["quiet_steps_p50"] >= 1 and r["quiet_hit_rate"] > 0
    else:
        assert r["run"] == f"on, quiet {quiet}" and r["quiet_steps_p50"] is None
        row = to_markdown({"cpu": "x", "config": cfg.__dict__, "flood": [], "single": [], "engine_steps": [r]})
        assert f"| on, quiet {quiet} | – | – | {r['steps']} | {r['flood_tokens']} |" in row


def test_the_ttft_targets_are_judged_on_the_fair_row_of_the_run():
    def row(quiet_ttft: float) -> dict:
        return {"run": "flood, fair + shares", "quiet": {"ttft_p50_ms": quiet_ttft, "gap_p50_ms": 6.0},
                "flood": {"ttft_p50_ms": 48.0}}
    (met,) = _ttft_targets([{"run": "quiet solo"}, row(11.9)])
    assert "two step times 12.0 ms (met)" in met and "TTFT p50 12.0 ms (met)" in met
    (missed,) = _ttft_targets([row(12.5)])
    assert "12.0 ms (not met)" in missed and missed.count("not met") == 2
    assert _ttft_targets([{"run": "quiet solo"}]) == []


def test_a_flood_only_report_has_the_flood_table_and_its_targets_only():
    cfg = FloodConfig(max_num_batched_tokens=512, flood_only=True)
    quiet = {"sent": 4, "done": 4, "refused": 0, "ttft_p50_ms": 100.0, "ttft_p99_ms": 150.0, "hit_rate": 0.9,
             "gap_p50_ms": 80.0}
    flood = {"sent": 40, "done": 10, "refused": 30, "ttft_p50_ms": 900.0, "served_tok_per_s": 500.0}
    text = to_markdown({"cpu": "x", "config": cfg.__dict__, "single": [], "engine_steps": [],
                        "flood": [{"run": "flood, fair + shares", "quiet": quiet, "flood": flood}]})
    assert "step budget 512 tokens" in text and "Targets (fair + shares)" in text
    assert "Single tenant" not in text and "engine driven step by step" not in text
