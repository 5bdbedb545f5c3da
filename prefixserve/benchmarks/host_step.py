"""Host-side cost of one engine step in steady decode, without the forward pass.

    python -m prefixserve.benchmarks.host_step [--seqs 64] [--prompt-tokens 2048] [--steps 300]

Drives the real Scheduler and KV manager and the real ModelRunner's host half
(`prepare_inputs`: block table updates, input arrays, attention metadata and the
backend's per-step plan) on random:qwen3-tiny, then `update_from_output` with one
token per sequence. No forward and no sampling run, so the pool is never
written; what is timed is the Python and array work that sits between two
forwards of a decode step. Only steps in which every sequence decodes one token
are timed. Prints the CPU and the median / p90 / min milliseconds per step.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from prefixserve.benchmarks.runner import machine_info
from prefixserve.kv import KVCacheConfig, KVCacheManager
from prefixserve.model.loader import load_model
from prefixserve.sampling_params import SamplingParams
from prefixserve.scheduler import Request, Scheduler, SchedulerConfig
from prefixserve.worker.model_runner import ModelRunner

MODEL = "random:qwen3-tiny"
BLOCK_SIZE = 16
TOKEN_BUDGET = 4096


def measure(num_seqs: int, prompt_tokens: int, steps: int, seed: int = 0) -> list[float]:
    """Seconds of each timed decode step."""
    # The first sequences decode while the last prompts are still prefilled: enough tokens for all.
    prefill_steps = -(-num_seqs * prompt_tokens // TOKEN_BUDGET)
    max_tokens = steps + prefill_steps + 8
    blocks = num_seqs * -(-(prompt_tokens + max_tokens) // BLOCK_SIZE)
    loaded = load_model(MODEL, seed=seed)
    runner = ModelRunner(loaded, block_size=BLOCK_SIZE, num_blocks=blocks)
    kv = KVCacheManager(KVCacheConfig(num_blocks=blocks, block_size=BLOCK_SIZE, model_identity=loaded.identity))
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=TOKEN_BUDGET, max_num_seqs=num_seqs,
                                          max_model_len=prompt_tokens + max_tokens), kv)
    rng = random.Random(seed)
    vocab = loaded.config.vocab_size
    for i in range(num_seqs):
        prompt = [rng.randrange(vocab) for _ in range(prompt_tokens)]
        scheduler.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                      max_tokens=max_tokens))
    times: list[float] = []
    with torch.inference_mode():
        while len(times) < steps:
            start = time.perf_counter()
            plan = scheduler.schedule()
            runner.prepare_inputs(plan)
            sampled = {s.request_id: [1] for s in plan.sequences if s.sample}
            scheduler.update_from_output(plan, sampled)
            elapsed = time.perf_counter() - start
            if len(plan.sequences) == num_seqs and all(s.num_tokens == 1 for s in plan.sequences):
                times.append(elapsed)
    return times


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=300, help="decode steps timed")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    times = sorted(measure(args.seqs, args.prompt_tokens, args.steps))
    result = {
        "median_ms": 1e3 * statistics.median(times),
        "p90_ms": 1e3 * times[int(0.9 * (len(times) - 1))],
        "min_ms": 1e3 * times[0],
    }
    print(f"CPU: {machine_info(torch.get_num_threads())['cpu']}")
    print(f"{args.seqs} sequences of {args.prompt_tokens} prompt tokens, {len(times)} decode steps: host ms per "
          f"step (schedule + prepare_inputs + update_from_output): median {result['median_ms']:.2f}, "
          f"p90 {result['p90_ms']:.2f}, min {result['min_ms']:.2f}")
    return result


if __name__ == "__main__":
    main()
