"""How the benchmark judges its targets from the runs it made."""
from __future__ import annotations

from prefixserve.benchmarks.engines import RequestRecord, RunResult
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


def _named(targets, prefix: str):
    return next(t for t in targets if t.name.startswith(prefix))


def test_bfloat16_is_judged_on_its_own_thresholds() -> None:
    roofline = {"prefill": {"fraction": 0.75}, "decode_b1": {"fraction": 0.75}}
    f32 = evaluate_targets([], {}, roofline, dtype="float32")
    bf16 = evaluate_targets([], {}, roofline, dtype="bfloat16")
    assert not _named(f32, "prefill").met and _named(bf16, "prefill").met      # 0.85 vs 0.70
    assert _named(f32, "batch-1 decode").met and not _named(bf16, "batch-1 decode").met  # 0.70 vs 0.80


def test_long_doc_qa_fraction_of_ideal_is_ideal_over_wall() -> None:
    runs = [RunResult("prefixserve", "long-doc-qa", [], 4.0, 100, 0)]
    bf16 = _named(evaluate_targets(runs, {"long-doc-qa": 100}, {}, dtype="bfloat16",
                                   ideal_seconds={"long-doc-qa": 3.0}), "long-doc-qa: fraction")
    assert bf16.measured == 0.75 and bf16.met is False and bf16.wanted == ">= 0.85"
    f32 = _named(evaluate_targets(runs, {"long-doc-qa": 100}, {}, dtype="float32",
                                  ideal_seconds={"long-doc-qa": 3.6}), "long-doc-qa: fraction")
    assert f32.measured == 0.9 and f32.met is None   # reported only: float32 had no such target


def test_no_sharing_within_1_2x_of_llama_cpp_in_bfloat16() -> None:
    def judged(ours: float, theirs: float):
        runs = [_run("prefixserve", ours), RunResult("llama.cpp", "no-sharing", [], theirs, 100, 0)]
        return _named(evaluate_targets(runs, {}, {}, dtype="bfloat16"), "no-sharing: within")
    assert judged(11.0, 10.0).met            # 1.1x slower: within
    assert not judged(12.5, 10.0).met        # 1.25x slower: not
    f32 = evaluate_targets([_run("prefixserve", 12.5), RunResult("llama.cpp", "no-sharing", [], 10.0, 100, 0)], {}, {})
    assert _named(f32, "no-sharing: ratio to llama.cpp").met is None


def _results(start: tuple[float, float], between_rounds: tuple[float, float] | None,
             around: tuple[float, float] | None = None):
    from prefixserve.benchmarks.limits import MachineLimits, ModelCost
    from prefixserve.benchmarks.runner import BenchConfig, BenchResults
    from prefixserve.benchmarks.workloads import build_workload
    from prefixserve.model import RANDOM_PRESETS
    flops, bandwidth = start
    res = BenchResults(BenchConfig(model="random:qwen3-tiny", workloads=("long-doc-qa",), quick=True), {},
                       MachineLimits(flops, {1024: flops}, bandwidth, "float32", 2),
                       ModelCost(RANDOM_PRESETS["qwen3-tiny"], 4), {"long-doc-qa": build_workload("long-doc-qa", True)})
    if between_rounds:
        res.roofline = {"prefill": {"matmul_flops": between_rounds[0], "fraction": 0.5},
                        "decode_b1": {"bandwidth_bytes": between_rounds[1], "fraction": 0.5},
                        "warm_ttft": {"ratio": 1.0}}
    if around:
        # 8 tokens each at TPOT 10, 20, ..., 50 ms: p50 30 ms
        records = [RequestRecord(f"r{i}", 100, 0, list(range(8)), 0.1, 0.1 + 0.07 * (i + 1)) for i in range(5)]
        res.runs.append(RunResult("prefixserve", "long-doc-qa", records, 2.0, 100, 0, extra={
            "limits_around": {"matmul_flops": around[0], "bandwidth_bytes": around[1]}}))
    return res


def _bound_at(res, limits) -> float:
    from prefixserve.benchmarks.limits import batched_decode_bound_s
    rnd = res.workloads["long-doc-qa"].rounds[0]
    contexts = [len(r.prompt_token_ids) + max(q.max_tokens for q in rnd) // 2 for r in rnd]
    return batched_decode_bound_s(res.cost, limits, contexts, min(r.shared_prefix_len for r in rnd))


def test_best_limits_are_the_highest_readings_anywhere_in_the_run() -> None:
    """The workloads' ideal times follow the highest matmul rate and bandwidth measured anywhere in the run
    (here each from a different reading); a low reading at the start does not loosen them."""
    from prefixserve.benchmarks.limits import MachineLimits, ideal_workload_seconds
    from prefixserve.benchmarks.report import decode_bounds, to_json
    best = MachineLimits(4e9, {1024: 4e9}, 3e9, "float32", 2)
    for start, rounds in [((1e9, 3e9), (4e9, 1e9)), ((4e9, 1e9), (1e9, 3e9)), ((4e9, 3e9), None)]:
        res = _results(start, rounds)
        w = res.workloads["long-doc-qa"]
        assert (res.best_limits().matmul_flops, res.best_limits().bandwidth_bytes) == (4e9, 3e9)
        assert decode_bounds(res, res.limits_around)["long-doc-qa"] == _bound_at(res, best)  # nothing read around
        assert to_json(res)["workloads"]["long-doc-qa"]["ideal_seconds"] == ideal_workload_seconds(w, res.cost, best)
    # the readings next to the batched decode's steps and around a workload's run count too
    res = _results((1e9, 1e9), (1e9, 1e9), around=(1e9, 5e9))
    res.roofline["batched_decode"] = {"matmul_flops": 6e9, "bandwidth_bytes": 2e9, "ratio": 1.0}
    assert (res.best_limits().matmul_flops, res.best_limits().bandwidth_bytes) == (6e9, 5e9)


def test_long_doc_qa_targets_are_judged_at_the_limits_read_around_its_run() -> None:
    """The fraction of the ideal time is judged against the readings taken around the run it times, the same
    ratio at the run's best readings reported next to it; the run's TPOT is reported at both, judged nothing."""
    from prefixserve.benchmarks.limits import MachineLimits, ideal_workload_seconds
    from prefixserve.benchmarks.report import targets_of
    res = _results((4e9, 3e9), (4e9, 3e9), around=(2e9, 1.5e9))
    around, best = MachineLimits(2e9, {1024: 4e9}, 1.5e9, "float32", 2), res.best_limits()
    assert res.limits_around("long-doc-qa") == around and best.bandwidth_bytes == 3e9
    targets = targets_of(res)
    tpot = [t for t in targets if t.name.startswith("long-doc-qa: TPOT p50")]
    assert [t.met for t in tpot] == [None, None]
    assert abs(tpot[0].measured - 0.03 / _bound_at(res, around)) < 1e-9
    assert abs(tpot[1].measured - 0.03 / _bound_at(res, best)) < 1e-9 and tpot[1].measured > tpot[0].measured
    w = res.workloads["long-doc-qa"]
    fraction = next(t for t in targets if t.name == "long-doc-qa: fraction of its ideal time (reported, no target)")
    assert abs(fraction.measured - ideal_workload_seconds(w, res.cost, around)["total_s"] / 2.0) < 1e-12


def test_batched_decode_target_is_the_median_of_paired_steps() -> None:
    from prefixserve.benchmarks.targets import BATCHED_DECODE
    roofline = {"batched_decode": {"ratio": 1.4}}
    assert _named(evaluate_targets([], {}, roofline), BATCHED_DECODE).met
    assert not _named(evaluate_targets([], {}, {"batched_decode": {"ratio": 1.6}}), BATCHED_DECODE).met
    assert _named(evaluate_targets([], {}, {}), BATCHED_DECODE).met is None


def test_limits_around_a_run_are_the_better_of_a_reading_before_and_after_it() -> None:
    from prefixserve.benchmarks.limits import MachineLimits
    from prefixserve.benchmarks.runner import _read_limits_around
    order = []
    readings = iter([MachineLimits(5e9, {}, 1e9, "float32", 2), MachineLimits(3e9, {}, 2e9, "float32", 2)])

    def read():
        order.append("read")
        return next(readings)

    def run():
        order.append("run")
        return RunResult("prefixserve", "long-doc-qa", [], 1.0, 1, 0)

    result = _read_limits_around(run, read)
    assert order == ["read", "run", "read"]
    assert result.extra["limits_around"] == {"matmul_flops": 5e9, "bandwidth_bytes": 2e9}
