"""`python -m prefixserve.benchmarks.replica_tenants`: the `tenants` workload on engine replicas.

Many tenants, each with its own long system prompt and salt, their questions interleaved at
random and sent `--concurrency` at a time. Runs 2 replicas under each router and 1 replica
with twice the pool (and twice the CPUs), one after another on one local Ray cluster, and
prints computed prompt tokens, hit rate, TTFT and throughput side by side, with ratios.
"""
from __future__ import annotations

import argparse
import asyncio
import platform
import random
import statistics
import time

from prefixserve.engine import EngineConfig
from prefixserve.replicas.policy import ROUTERS, RoutingConfig
from prefixserve.sampling_params import SamplingParams

WORDS = ("account billing cluster deploy engine failover gateway health index journal kernel "
         "latency metric network operator policy quota replica schema tenant upgrade volume "
         "window").split()


def tenant_prompts(num_tenants: int, per_tenant: int, system_words: int, seed: int):
    rng = random.Random(seed)
    systems = [f"You are the assistant of tenant {t}. " + " ".join(
        rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(system_words))
        for t in range(num_tenants)]
    order = [t for t in range(num_tenants) for _ in range(per_tenant)]
    rng.shuffle(order)
    return [(f"tenant-{t}", systems[t] + f"\nQuestion {i}: what about {rng.choice(WORDS)}?")
            for i, t in enumerate(order)]


async def drive(front, requests, concurrency: int, max_tokens: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []
    out_tokens = 0

    async def one(i: int, salt: str, text: str) -> None:
        nonlocal out_tokens
        async with sem:
            t0 = time.perf_counter()
            stream = await front.add_request(
                f"bench-{i}", {"prompt_token_ids": front.tokenizer.encode(text)},
                SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                cache_salt=salt)
            first = None
            async for out in stream:
                if first is None:
                    first = time.perf_counter() - t0
                last = out
            ttfts.append(first)
            out_tokens += len(last.outputs[0].token_ids)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, s, t) for i, (s, t) in enumerate(requests)))
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "ttft_p50": statistics.median(ttfts),
            "ttft_mean": statistics.fmean(ttfts), "req_per_s": len(requests) / wall,
            "out_tok_per_s": out_tokens / wall}


def run_one(label: str, replicas: int, router: str, blocks: int, cpus: float, args, requests):
    import ray

    from prefixserve.replicas.service import ReplicaConfig, ReplicaService
    engine = EngineConfig(model=args.model, block_size=args.block_size, num_kv_blocks=blocks,
                          dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens)
    service = ReplicaService(engine, ReplicaConfig(num_replicas=replicas, replica_cpus=cpus,
                                                   app_name=f"bench-{label}",
                                                   routing=RoutingConfig(router=router)))
    front = service.start()
    try:
        async def main():
            front.start()
            return await drive(front, requests, args.concurrency, args.max_tokens)
        timing = asyncio.run(main())
        time.sleep(1.0)   # replicas publish their stats every 50 ms; let the last ones land
        stats = ray.get(service.hub.stats.remote())
    finally:
        service.stop()
    prompt = sum(s["prompt_tokens"] for s in stats.values())
    cached = sum(s["cached_prompt_tokens"] for s in stats.values())
    return {"label": label, "replicas": replicas, "prompt": prompt,
            "computed": sum(s["computed_prompt_tokens"] for s in stats.values()),
            "hit_rate": cached / prompt if prompt else 0.0,
            "per_replica": sorted(s["prompt_tokens"] for s in stats.values()), **timing}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="random:qwen3-tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--requests-per-tenant", type=int, default=6)
    p.add_argument("--system-words", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--blocks-per-replica", type=int, default=400)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    import ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    requests = tenant_prompts(args.tenants, args.requests_per_tenant, args.system_words, args.seed)
    rows = []
    try:
        for router in ROUTERS:
            rows.append(run_one(router, 2, router, args.blocks_per_replica, 1.0, args, requests))
        rows.append(run_one("single-2x-pool", 1, "prefix-aware", 2 * args.blocks_per_replica,
                            2.0, args, requests))
    finally:
        ray.shutdown()
    single = rows[-1]
    print(f"CPU: {platform.processor() or platform.machine()}; {len(requests)} requests, "
          f"{args.tenants} tenants, concurrency {args.concurrency}, model {args.model}")
    print("| run | replicas | prompt tokens | computed prompt tokens (/ single) | hit rate (/ single) "
          "| TTFT p50 s | TTFT mean s | req/s | out tok/s | prompt tokens per replica |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['label']} | {r['replicas']} | {r['prompt']} | {r['computed']} "
              f"({r['computed'] / single['computed']:.2f}) | {r['hit_rate']:.3f} "
              f"({r['hit_rate'] / single['hit_rate']:.2f}) | {r['ttft_p50']:.3f} | "
              f"{r['ttft_mean']:.3f} | {r['req_per_s']:.2f} | {r['out_tok_per_s']:.1f} | "
              f"{r['per_replica']} |")
    pa = rows[0]
    rr = next(r for r in rows if r["label"] == "round-robin")
    print(f"prefix-aware hit rate / round-robin's: {pa['hit_rate'] / rr['hit_rate']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
