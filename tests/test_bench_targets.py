"""How the benchmark judges its targets from the runs it made."""
from __future__ import annotations

from prefixserve.benchmarks.engines import RunResult
from prefixserve.benchmarks.targets import evaluate_targets

ON_OFF = "no-sharing: cost of prefix caching (on / off)"


def _run(engine: str, wall: float, **extra) -> RunResult:
    return RunResult(engine, "no-sharing", [], wall, 100, 0, extra=dict(extra))


def _on_off(runs: list[RunResult]):
    return next(t for t in evaluate_targets(runs, {}, {}) if t.name == ON_OFF)


def test_on_off_cost_is_the_median_of_back_to_back_pairs() -> None:
    # the best runs alone would read 10 / 9 = 1.11; the pairs say caching costs 1%
    runs = [_run("prefixserve", 10.0, paired_ratios=[1.30, 1.01, 0.99]), _run("prefixserve-nocache", 9.0)]
    target = _on_off(runs)
    assert target.measured == 1.01 and target.met
    assert "median of 3" in target.detail


def test_on_off_cost_without_pairs_is_the_wall_time_ratio() -> None:
    target = _on_off([_run("prefixserve", 10.0), _run("prefixserve-nocache", 9.0)])
    assert abs(target.measured - 10.0 / 9.0) < 1e-12 and not target.met
