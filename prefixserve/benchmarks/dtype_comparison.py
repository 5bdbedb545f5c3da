"""bfloat16 against float32 on one machine: prefixserve's wall time per workload in each dtype of one
`prefixserve bench --dtype float32 --dtype bfloat16` run, and the issue's target for CPUs with AMX.

On AMX, oneDNN multiplies bfloat16 about 6x faster than float32 and decode reads half the bytes, so
long-doc-qa in bfloat16 should run at least AMX_SPEEDUP times faster end to end than in float32. Without
AMX (avx512_bf16 gives about 2x the float32 rate) the ratio is reported, not judged.
"""
from __future__ import annotations

from dataclasses import dataclass

from prefixserve.benchmarks.runner import BenchResults
from prefixserve.benchmarks.targets import Target

AMX_SPEEDUP = 3.0
TARGET_WORKLOAD = "long-doc-qa"
ENGINE = "prefixserve"          # cold, cache on: the run each dtype's own targets judge


@dataclass(frozen=True)
class DtypeSpeedup:
    workload: str
    float32_s: float
    bfloat16_s: float

    @property
    def speedup(self) -> float:
        """float32's wall time over bfloat16's: how many times faster bfloat16 ran."""
        return self.float32_s / self.bfloat16_s


def speedups(float32: BenchResults, bfloat16: BenchResults) -> list[DtypeSpeedup]:
    """Per workload prefixserve ran in both dtypes, in float32's order."""
    if float32.config.dtype != "float32" or bfloat16.config.dtype != "bfloat16":
        raise ValueError(f"compares a float32 run with a bfloat16 one, got {float32.config.dtype} and "
                         f"{bfloat16.config.dtype}")
    walls = {r.workload: r.wall_s for r in bfloat16.runs if r.engine == ENGINE}
    return [DtypeSpeedup(r.workload, r.wall_s, walls[r.workload])
            for r in float32.runs if r.engine == ENGINE and r.workload in walls]


def amx_target(float32: BenchResults, bfloat16: BenchResults) -> Target:
    """Judged only where both runs saw AMX (`machine["amx"]`); elsewhere the ratio is reported."""
    name = f"{TARGET_WORKLOAD}: bfloat16 end to end vs float32, on a CPU with AMX"
    wanted = f">= {AMX_SPEEDUP:g}x"
    found = next((s for s in speedups(float32, bfloat16) if s.workload == TARGET_WORKLOAD), None)
    if found is None:
        return Target(name, wanted, None, None, f"prefixserve did not run {TARGET_WORKLOAD} in both dtypes")
    detail = f"{found.float32_s:.2f} s in float32, {found.bfloat16_s:.2f} s in bfloat16"
    if not (float32.machine.get("amx") and bfloat16.machine.get("amx")):
        return Target(name, wanted, found.speedup, None, detail + "; this CPU has no AMX: reported, not judged")
    return Target(name, wanted, found.speedup, found.speedup >= AMX_SPEEDUP, detail)
