"""What grammar-constrained rows cost the unconstrained rows of the same batch.

    python -m prefixserve.benchmarks.structured_overhead [--model random:qwen3-tiny]
        [--plain 8] [--constrained 2] [--tokens 96] [--rounds 5] [--threads N] [--compare-masks]

Two batches of the same size decode together, steady state, through LLMEngine.step(): `plain`
unconstrained greedy rows plus `constrained` rows that are either unconstrained too (baseline)
or held to a JSON schema (an array of at least 200 strings, so the grammar never lets them stop
early). Both batches run the same forward; the difference is computing the constrained rows'
masks and applying them. Only steps in which every row decodes are timed; the two kinds of
round alternate after a warm-up round of each, and the script prints the CPU, the load before
and after, the median step time of each and its ratio to the baseline: the slowdown every
unconstrained row of such a batch sees. Wall time and the process's CPU time are both
reported: wall time is what the rows wait for; CPU time counts every thread, so mask work moved
onto the sampler's worker thread (structured/mask_worker.py) still counts there even when it
overlaps the forward. Run it under `flock /tmp/prefixserve-bench.lock` on a quiet machine.

On random:qwen3-0.6b (a decode step of hundreds of ms, a 151936-token vocabulary) use fewer
tokens and rounds: `--model random:qwen3-0.6b --tokens 24 --rounds 2`.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from prefixserve import EngineConfig, LLMEngine, SamplingParams
from prefixserve.benchmarks.runner import machine_info
from prefixserve.structured import StructuredOutput

SCHEMA = {"type": "array", "items": {"type": "string"}, "minItems": 200}


def one_round(engine: LLMEngine, plain: int, constrained: int, tokens: int, structured: bool,
              tag: str) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each step in which every request decodes."""
    free = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    held = SamplingParams(max_tokens=tokens, temperature=0.0,
                          structured=StructuredOutput.json_schema(SCHEMA)) if structured else free
    total = plain + constrained
    for i in range(total):
        prompt = f"Request {tag}-{i}: list the reasons, one per line, in detail."
        engine.add_request(f"{tag}-{i}", prompt, held if i < constrained else free)
    times = []
    while engine.has_unfinished_requests():
        start, cpu = time.perf_counter(), time.process_time()
        outputs = engine.step()
        elapsed = (time.perf_counter() - start, time.process_time() - cpu)
        stats = engine.stats()
        if stats.num_running == total and stats.num_waiting == 0 and \
                all(len(o.outputs[0].token_ids) > 1 for o in outputs) and len(outputs) == total:
            times.append(elapsed)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:qwen3-tiny")
    parser.add_argument("--plain", type=int, default=8)
    parser.add_argument("--constrained", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--compare-masks", action="store_true",
                        help="time the constrained rows twice: masks on the sampler's worker thread "
                             "during the forward, and inline after it (default: the device's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    engine = LLMEngine(EngineConfig(model=args.model, seed=0, block_size=16,
                                    num_kv_blocks=(args.plain + args.constrained) * 16 + 64))
    sampler = engine.runner.sampler
    # (label, constrained, masks on the worker); None keeps what the runner chose for the device.
    kinds = [("all rows unconstrained", False, None)]
    label = f"{args.constrained} rows JSON-constrained"
    if args.compare_masks:
        kinds += [(label + ", masks on the worker", True, True), (label + ", masks inline", True, False)]
    else:
        kinds += [(f"{label} (masks {'on the worker' if sampler.overlap_masks else 'inline'})",
                   True, None)]
    default_overlap = sampler.overlap_masks
    times: dict[str, list[tuple[float, float]]] = {k[0]: [] for k in kinds}
    for r in range(-1, args.rounds):  # round -1 warms up: the first grammar builds the tokenizer view
        for i, (name, structured, overlap) in enumerate(kinds):
            sampler.overlap_masks = default_overlap if overlap is None else overlap
            steps = one_round(engine, args.plain, args.constrained, args.tokens if r >= 0 else 8,
                              structured, f"{r}-{i}")
            if r >= 0:
                times[name] += steps
    info = machine_info(torch.get_num_threads())
    print(f"cpu: {info['cpu']} ({info['logical_cpus']} logical, {info['threads']} threads), "
          f"torch {info['torch']}")
    print("load average (1, 5, 15 min) before: %.2f %.2f %.2f, after: %.2f %.2f %.2f"
          % (*load_before, *os.getloadavg()))
    print(f"model {args.model}: {args.plain} unconstrained + {args.constrained} rows, "
          f"{len(times[kinds[0][0]])} timed decode steps per kind")
    base_ms, base_cpu = (statistics.median(t[k] for t in times[kinds[0][0]]) * 1e3 for k in (0, 1))
    for name, _, _ in kinds:
        wall, cpu = (statistics.median(t[k] for t in times[name]) * 1e3 for k in (0, 1))
        print(f"median step, {name}: {wall:.2f} ms wall, {cpu:.2f} ms CPU; "
              f"ratio {wall / base_ms:.3f} wall, {cpu / base_cpu:.3f} CPU")


if __name__ == "__main__":
    main()
