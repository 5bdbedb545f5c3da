"""What grammar-constrained rows cost the unconstrained rows of the same batch.

    python -m prefixserve.benchmarks.structured_overhead [--model random:qwen3-tiny]
        [--plain 8] [--constrained 2] [--tokens 96] [--rounds 5]

Two batches of the same size decode together, steady state, through LLMEngine.step(): `plain`
unconstrained greedy rows plus `constrained` rows that are either unconstrained too (baseline)
or held to a JSON schema (an array of at least 200 strings, so the grammar never lets them stop
early). Both batches run the same forward; the difference is computing the constrained rows'
masks and applying them. Only steps in which every row decodes are timed; the two kinds of
round alternate, and the script prints the CPU, the median step time of each and their ratio
(constrained / baseline): the slowdown every unconstrained row of such a batch sees. Wall time
and the process's CPU time are both reported: on a machine other jobs share, CPU time (what the
step itself consumed, all threads) is the steadier of the two.
"""
from __future__ import annotations

import argparse
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
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, seed=0, block_size=16,
                                    num_kv_blocks=(args.plain + args.constrained) * 16 + 64))
    one_round(engine, args.plain, args.constrained, 8, True, "warm")  # compiles, first grammar
    baseline: list[float] = []
    held: list[float] = []
    for r in range(args.rounds):
        baseline += one_round(engine, args.plain, args.constrained, args.tokens, False, f"b{r}")
        held += one_round(engine, args.plain, args.constrained, args.tokens, True, f"c{r}")
    base_ms, base_cpu = (statistics.median(t[k] for t in baseline) * 1e3 for k in (0, 1))
    held_ms, held_cpu = (statistics.median(t[k] for t in held) * 1e3 for k in (0, 1))
    info = machine_info(torch.get_num_threads())
    print(f"cpu: {info['cpu']} ({info['logical_cpus']} logical, {info['threads']} threads), "
          f"torch {info['torch']}")
    print(f"model {args.model}: {args.plain} unconstrained + {args.constrained} rows, "
          f"{len(baseline)} / {len(held)} timed decode steps")
    print(f"median step, all rows unconstrained: {base_ms:.2f} ms wall, {base_cpu:.2f} ms CPU")
    print(f"median step, {args.constrained} rows JSON-constrained: {held_ms:.2f} ms wall, "
          f"{held_cpu:.2f} ms CPU")
    print(f"ratio (slowdown of the unconstrained rows): {held_ms / base_ms:.3f} wall, "
          f"{held_cpu / base_cpu:.3f} CPU")


if __name__ == "__main__":
    main()
