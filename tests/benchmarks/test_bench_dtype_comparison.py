"""`prefixserve bench` in both dtypes compares them: prefixserve's wall time per workload, and the target
for CPUs with AMX (long-doc-qa in bfloat16 at least 3x faster than in float32), judged only there."""
from __future__ import annotations

import json
import re

import pytest

from prefixserve.benchmarks.dtype_comparison import AMX_SPEEDUP, amx_target, speedups
from prefixserve.benchmarks.engines.base import RunResult
from prefixserve.benchmarks.runner import BenchConfig, BenchResults
from prefixserve.entrypoints.cli import main
from prefixserve.platforms.cpu.native.isa import cpu_probe


def test_a_run_in_both_dtypes_reports_bfloat16s_speed_up_from_its_own_runs(tmp_path, capsys) -> None:
    out = tmp_path / "out"
    assert main(["bench", "--model", "random:qwen3-tiny", "--quick", "--dtype", "float32", "--dtype", "bfloat16",
                 "--workload", "long-doc-qa", "--workload", "system-prompt", "--engine", "prefixserve",
                 "--cache-dir", str(tmp_path / "cache"), "--json", str(out / "r.json"),
                 "--markdown", str(out / "r.md")]) == 0
    walls, amx = {}, set()
    for dtype in ("float32", "bfloat16"):
        data = json.loads((out / f"r-{dtype}.json").read_text())
        walls[dtype] = {r["workload"]: r["wall_s"] for r in data["runs"] if r["engine"] == "prefixserve"}
        amx.add(data["machine"]["amx"])
    assert amx == {cpu_probe("_is_amx_tile_supported")}
    text = (out / "r.md").read_text()
    section = text[text.index("## bfloat16 against float32"):]
    assert section.strip() in capsys.readouterr().out
    for workload in ("long-doc-qa", "system-prompt"):
        row = re.search(rf"^\| {workload} \| [^|]+ \| [^|]+ \| ([0-9.]+)x \|$", section, re.M)
        assert row and float(row[1]) == pytest.approx(walls["float32"][workload] / walls["bfloat16"][workload],
                                                      abs=0.006)
    verdict = re.search(r"^\| long-doc-qa: bfloat16 end to end vs float32, on a CPU with AMX \| >= 3x \| "
                        r"([0-9.]+) \| (.+) \|$", section, re.M)
    ratio = walls["float32"]["long-doc-qa"] / walls["bfloat16"]["long-doc-qa"]
    want = ("**met**" if ratio >= AMX_SPEEDUP else "**not met**") if amx == {True} else "reported"
    assert verdict and verdict[2] == want


def results(dtype: str, amx: bool, walls: dict[tuple[str, str], float]) -> BenchResults:
    runs = [RunResult(engine, workload, [], wall, 0, 0) for (engine, workload), wall in walls.items()]
    return BenchResults(BenchConfig(dtype=dtype), {"amx": amx}, None, None, {}, runs)


@pytest.mark.parametrize("amx, f32_s, bf16_s, met", [(True, 9.0, 2.5, True), (True, 9.0, 3.5, False),
                                                      (False, 9.0, 2.5, None), (False, 9.0, 4.5, None)])
def test_the_amx_target_is_judged_on_amx_alone(amx: bool, f32_s: float, bf16_s: float, met) -> None:
    # the warm and uncached runs are other engines: only prefixserve's cold run counts
    f32 = results("float32", amx, {("prefixserve", "long-doc-qa"): f32_s, ("prefixserve-warm", "long-doc-qa"): 1.0})
    bf16 = results("bfloat16", amx, {("prefixserve", "long-doc-qa"): bf16_s,
                                     ("prefixserve-nocache", "long-doc-qa"): 99.0})
    target = amx_target(f32, bf16)
    assert target.measured == pytest.approx(f32_s / bf16_s) and target.met is met


def test_without_long_doc_qa_in_both_dtypes_nothing_is_measured() -> None:
    f32 = results("float32", True, {("prefixserve", "long-doc-qa"): 9.0, ("prefixserve", "multi-turn"): 4.0})
    bf16 = results("bfloat16", True, {("prefixserve", "multi-turn"): 2.0})
    assert [(s.workload, s.speedup) for s in speedups(f32, bf16)] == [("multi-turn", 2.0)]
    target = amx_target(f32, bf16)
    assert target.measured is None and target.met is None and "did not run long-doc-qa" in target.detail
    with pytest.raises(ValueError, match="compares a float32 run with a bfloat16 one"):
        speedups(bf16, f32)
