"""The per-row sampler (worker/sampler.py) against the batched one (worker/batched_sampler.py) on this
machine: median milliseconds a step for a batch of logit rows of the 0.6B model's vocabulary, the two
alternating step by step so both see the same load.

    python scripts/sampler_bench.py [--vocab 151936] [--steps 15]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from prefixserve.sampling_params import SamplingParams
from prefixserve.worker.batched_sampler import BatchedSampler
from prefixserve.worker.sampler import Sampler, SamplingRow

CASES = {
    "greedy": dict(temperature=0.0),
    "temperature+top_p": dict(temperature=0.8, top_p=0.9),
    "seeded+penalties+logprobs": dict(temperature=0.8, top_k=40, presence_penalty=0.5, repetition_penalty=1.1,
                                      logprobs=5),
}


def rows_for(case: str, count: int, rng: random.Random) -> list[SamplingRow]:
    fields = CASES[case]
    seeded = "seeded" in case
    return [SamplingRow(SamplingParams(**fields, seed=i if seeded else None), [rng.randrange(1000) for _ in range(512)],
                        [rng.randrange(1000) for _ in range(64)],
                        generator=torch.Generator().manual_seed(i) if seeded else None) for i in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    rng = random.Random(0)
    samplers = {"per-row": Sampler(), "batched": BatchedSampler()}
    print(f"torch threads {torch.get_num_threads()}, vocab {args.vocab}; median ms a step")
    print(f"{'case':28} {'rows':>5} {'per-row':>9} {'batched':>9}")
    for case in CASES:
        for count in (1, 16, 64):
            rows = rows_for(case, count, rng)
            logits = torch.randn(count, args.vocab)
            times: dict[str, list[float]] = {name: [] for name in samplers}
            for _ in range(args.steps):
                for name, sampler in samplers.items():
                    work = logits.clone()
                    start = time.perf_counter()
                    sampler(work, rows, default_generator=torch.Generator().manual_seed(1))
                    times[name].append(1000 * (time.perf_counter() - start))
            print(f"{case:28} {count:5d} {statistics.median(times['per-row']):9.2f} "
                  f"{statistics.median(times['batched']):9.2f}")


if __name__ == "__main__":
    main()
