"""The figures of one run: throughput, latency percentiles, cache use, memory, and distance from ideal."""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Optional

from prefixserve.benchmarks.engines import RunResult
from prefixserve.benchmarks.limits import MachineLimits, ModelCost, ideal_workload_seconds
from prefixserve.benchmarks.workloads import Workload


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class Figures:
    engine: str
    workload: str
    requests: int
    wall_s: float
    requests_per_s: float
    output_tokens_per_s: float
    prompt_tokens: int
    computed_prompt_tokens: int
    ideal_computed_tokens: int
    cache_hit_rate: float          # prompt tokens not computed / prompt tokens
    ttft_p50_s: float
    ttft_p90_s: float
    tpot_p50_s: Optional[float]    # time per output token after the first
    peak_rss_mib: float
    ideal_s: Optional[float]       # only uncached tokens, at the machine's peak (None: limits not measured)
    fraction_of_ideal: Optional[float]  # ideal_s / wall_s
    note: str

    def as_dict(self) -> dict:
        return asdict(self)


def figures_of(run: RunResult, workload: Workload, cost: Optional[ModelCost] = None,
               limits: Optional[MachineLimits] = None) -> Figures:
    recs = run.records
    prompt = sum(r.prompt_tokens for r in recs)
    outputs = sum(len(r.output_token_ids) for r in recs)
    tpots = [t for t in (r.tpot_s for r in recs) if t is not None]
    ideal = ideal_workload_seconds(workload, cost, limits)["total_s"] if cost and limits else None
    return Figures(
        engine=run.engine, workload=run.workload, requests=len(recs), wall_s=run.wall_s,
        requests_per_s=len(recs) / run.wall_s, output_tokens_per_s=outputs / run.wall_s,
        prompt_tokens=prompt, computed_prompt_tokens=run.computed_prompt_tokens,
        ideal_computed_tokens=workload.ideal_computed_tokens(),
        cache_hit_rate=sum(r.cached_tokens for r in recs) / prompt if prompt else 0.0,
        ttft_p50_s=percentile([r.ttft_s for r in recs], 50), ttft_p90_s=percentile([r.ttft_s for r in recs], 90),
        tpot_p50_s=statistics.median(tpots) if tpots else None,
        peak_rss_mib=run.peak_rss_bytes / 2**20, ideal_s=ideal,
        fraction_of_ideal=ideal / run.wall_s if ideal is not None else None,
        note=run.note)


def output_agreement(a: RunResult, b: RunResult) -> tuple[int, int]:
    """(requests whose output token ids are identical in both runs, requests compared)."""
    theirs = {r.request_id: r.output_token_ids for r in b.records}
    same = sum(1 for r in a.records if theirs.get(r.request_id) == r.output_token_ids)
    return same, len(a.records)
