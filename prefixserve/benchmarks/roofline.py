"""prefixserve's single-request speeds, each set against the machine's limit for it.

prefill: one 512-token prompt, nothing cached, timed to its first token.
decode: one sequence, time per output token after the first.
The prefill is set against the best matmul peak read before each of its rounds
and after the last: on a shared machine the limits of some minutes earlier say
little (peaks of 108-148 GFLOP/s and 16-24 GB/s seen; 81 and 155 in one run;
39-77 GB/s in one run on a 2-core Zen 5 EPYC). The decode figures pair readings
with steps instead (below).
warm TTFT: a long prefix already cached plus a new 32-token suffix, against
the first-token time of a prompt made of that suffix alone (what computing only
the uncached tokens costs).
decode, and batched decode (long-doc-qa's requests: 16 questions over one
1024-token document, decoding together): each step timed right after a quick
reading of both limits and set against its bound at that reading; the median of
those paired ratios. The bandwidth read 39-77 GB/s within one run on a 2-core Zen 5
EPYC: a bound from a reading seconds or minutes away from the steps it judges
measures the machine's drift as much as the engine.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import replace

import torch

from prefixserve import LLMEngine, SamplingParams
from prefixserve.benchmarks.limits import LimitProbe, MachineLimits, ModelCost, batched_decode_bound_s, \
    ideal_prefill_tokens_per_s, measure_matmul
from prefixserve.benchmarks.workloads import TOKEN_HIGH, TOKEN_LOW, build_workload

_ids = iter(range(1 << 62))


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(n)]


def time_request(engine: LLMEngine, prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
    """(time to first token, end-to-end time, output tokens) of one request alone on the engine."""
    rid = f"roofline-{next(_ids)}"
    arrival = time.monotonic()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                       arrival_time=arrival)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                m = out.metrics
                return m.first_token_time - arrival, m.finished_time - arrival, len(out.outputs[0].token_ids)


def measure_roofline(engine: LLMEngine, cost: ModelCost, limits: MachineLimits, quick: bool,
                     seed: int = 11) -> dict[str, dict[str, float]]:
    rng = random.Random(seed)
    repeat = 2 if quick else 3
    prefill_len, decode_tokens, doc_len, suffix_len = (512, 9, 512, 32) if quick else (512, 33, 1024, 32)

    time_request(engine, _tokens(rng, 64), 2)  # warm-up: first-call allocations are not steady state
    prefill_times, peaks = [], []
    dtype = getattr(torch, limits.dtype)
    for _ in range(repeat):
        peaks.append(max(measure_matmul(dtype, tuple(limits.matmul_by_size), repeat=2).values()))
        prefill_times.append(time_request(engine, _tokens(rng, prefill_len), 1)[0])
    peaks.append(max(measure_matmul(dtype, tuple(limits.matmul_by_size), repeat=2).values()))
    prefill_rate = prefill_len / min(prefill_times)
    prefill_limits = replace(limits, matmul_flops=max(peaks))
    prefill_ideal = ideal_prefill_tokens_per_s(cost, prefill_limits, prefill_len)

    single = _paired_decode(engine, cost, limits, [_tokens(rng, 64)], 0, decode_tokens - 1)

    doc = _tokens(rng, doc_len)
    time_request(engine, doc + _tokens(rng, suffix_len), 1)
    # the two kinds alternate, and each keeps its fastest run: measured one block after the other, a drift
    # of the machine between the blocks moved the ratio (0.66-1.56 on one Zen 5 EPYC in a day, the suffix
    # alone 56-97 ms)
    warm_runs, suffix_runs = [], []
    for _ in range(repeat):
        warm_runs.append(time_request(engine, doc + _tokens(rng, suffix_len), 1)[0])
        suffix_runs.append(time_request(engine, _tokens(rng, suffix_len), 1)[0])
    warm, suffix_only = min(warm_runs), min(suffix_runs)
    batched = measure_batched_decode(engine, cost, limits, quick)
    return {
        "prefill": {"tokens": prefill_len, "tokens_per_s": prefill_rate, "ideal_tokens_per_s": prefill_ideal,
                    "matmul_flops": prefill_limits.matmul_flops, "fraction": prefill_rate / prefill_ideal},
        "decode_b1": {"steps_per_s": 1.0 / single["step_s"], "ideal_steps_per_s": 1.0 / single["bound_s"],
                      "steps": single["steps"], "bandwidth_bytes": single["bandwidth_bytes"],
                      "fraction": 1.0 / single["ratio"]},
        "warm_ttft": {"prefix_tokens": doc_len, "suffix_tokens": suffix_len, "warm_ttft_s": warm,
                      "suffix_only_ttft_s": suffix_only, "ratio": warm / suffix_only},
        "batched_decode": batched,
    }


def measure_batched_decode(engine: LLMEngine, cost: ModelCost, limits: MachineLimits, quick: bool) -> dict:
    """long-doc-qa's requests decoding together (their prefill untimed), step by step against the limits
    read just before each step (_paired_decode)."""
    rnd = build_workload("long-doc-qa", quick).rounds[0]
    shared = min(r.shared_prefix_len for r in rnd)
    out = _paired_decode(engine, cost, limits, [list(r.prompt_token_ids) for r in rnd], shared, 6 if quick else 24)
    return {"sequences": len(rnd), "shared_tokens": shared, **out}


def _paired_decode(engine: LLMEngine, cost: ModelCost, limits: MachineLimits, prompts: list[list[int]],
                   shared: int, steps: int) -> dict:
    """The prompts decoding together for `steps` steps after their first tokens (prefill untimed): each step
    timed right after a LimitProbe reading and set against batched_decode_bound_s at that reading, the
    prompts' first `shared` tokens one run they all read. The medians of the step times, the bounds, the
    readings, and of the paired ratios (step / its bound)."""
    ids = {f"roofline-{next(_ids)}": prompt for prompt in prompts}
    for rid, prompt in ids.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True))
    made = dict.fromkeys(ids, 0)

    def step() -> None:
        for out in engine.step():
            if out.request_id in made:
                made[out.request_id] = len(out.outputs[0].token_ids)

    while min(made.values()) == 0:
        step()
    probe = LimitProbe(getattr(torch, limits.dtype))
    ratios, seconds, bounds, flops, bandwidths = [], [], [], [], []
    while max(made.values()) <= steps and engine.has_unfinished_requests():
        # every sequence decodes one token this step, at its context so far
        contexts = [len(prompt) + made[rid] for rid, prompt in ids.items() if made[rid] <= steps]
        peak, bandwidth = probe.read()
        start = time.perf_counter()
        step()
        elapsed = time.perf_counter() - start
        bound = batched_decode_bound_s(cost, replace(limits, matmul_flops=peak, bandwidth_bytes=bandwidth),
                                       contexts, shared)
        ratios.append(elapsed / bound)
        seconds.append(elapsed)
        bounds.append(bound)
        flops.append(peak)
        bandwidths.append(bandwidth)
    while engine.has_unfinished_requests():
        engine.step()
    median = statistics.median
    return {"steps": len(ratios), "ratio": median(ratios), "step_s": median(seconds), "bound_s": median(bounds),
            "matmul_flops": median(flops), "bandwidth_bytes": median(bandwidths)}
