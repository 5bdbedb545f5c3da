"""Micro-benchmarks of the KV bookkeeping (no model, no torch work).

    python -m prefixserve.benchmarks.kv_micro [--hash-tokens 100000] [--prompt-tokens 4096]

Prints tokens hashed per second for each hash algorithm, and the cost per request of the
lookup + allocate (+ free) calls the scheduler makes for one prompt, cold (nothing cached) and
warm (all but the last block cached), plus the cost of a one-token decode allocation.
"""
from __future__ import annotations

import argparse
import random

from prefixserve.benchmarks.timing import best_seconds
from prefixserve.kv import HASH_ALGOS, BlockHasher, KVCacheConfig, KVCacheManager

VOCAB = 151936


def bench_hashing(num_tokens: int, block_size: int, repeat: int) -> dict[str, float]:
    """Tokens per second of BlockHasher.hash_prompt for each algorithm."""
    rng = random.Random(0)
    tokens = [rng.randrange(VOCAB) for _ in range(num_tokens)]
    rates = {}
    for algo in HASH_ALGOS:
        hasher = BlockHasher(algo, "kv-micro-model")
        seconds = best_seconds(lambda: hasher.hash_prompt(tokens, block_size), repeat, warmup=False)
        rates[algo] = num_tokens / seconds
    return rates


def _request_cycle(kv: KVCacheManager, rid: str, prompt: list[int]) -> None:
    hit = kv.find_cached_prefix(rid, prompt)
    alloc = kv.allocate_slots(rid, prompt, hit.num_tokens, len(prompt) - hit.num_tokens, hit=hit)
    assert alloc is not None, "benchmark pool too small"
    kv.free(rid)


def bench_requests(prompt_tokens: int, block_size: int, algo: str, caching: bool,
                   num_requests: int, repeat: int) -> dict[str, float]:
    """Microseconds per request for lookup + allocate + free of a prompt_tokens prompt (best of
    `repeat` passes of num_requests requests each)."""
    rng = random.Random(1)
    base = [rng.randrange(VOCAB) for _ in range(prompt_tokens)]
    # Distinct first tokens make every cold prompt miss from its first block.
    cold_prompts = [[i % VOCAB] + base[1:] for i in range(num_requests)]
    blocks_per_prompt = -(-prompt_tokens // block_size)
    config = KVCacheConfig(num_blocks=4 * blocks_per_prompt, block_size=block_size,
                           enable_prefix_caching=caching, hash_algo=algo,
                           model_identity="kv-micro-model")

    def cold() -> None:
        kv = KVCacheManager(config)
        for i, prompt in enumerate(cold_prompts):
            _request_cycle(kv, f"cold{i}", prompt)

    warm_kv = KVCacheManager(config)
    _request_cycle(warm_kv, "prime", base)

    def warm() -> None:
        for i in range(num_requests):
            _request_cycle(warm_kv, f"warm{i}", base)

    steps = 4 * block_size * 8
    seq = base + [rng.randrange(VOCAB) for _ in range(steps)]

    def decode() -> None:
        kv = KVCacheManager(config)
        kv.allocate_slots("dec", seq, 0, prompt_tokens)
        for n in range(prompt_tokens, prompt_tokens + steps):
            kv.allocate_slots("dec", seq, n, 1)

    # decode() also pays for one prompt allocation; it is measured alone and taken off.
    prompt_only = best_seconds(lambda: KVCacheManager(config).allocate_slots(
        "p", seq, 0, prompt_tokens), repeat, warmup=False)
    return {
        "cold_us": best_seconds(cold, repeat, warmup=False) / num_requests * 1e6,
        "warm_us": best_seconds(warm, repeat, warmup=False) / num_requests * 1e6,
        "decode_us": max(0.0, best_seconds(decode, repeat, warmup=False) - prompt_only) / steps * 1e6,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hash-tokens", type=int, default=100_000)
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    for name in ("hash_tokens", "prompt_tokens", "block_size", "requests", "repeat"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")

    print(f"hash_prompt, {args.hash_tokens} tokens, block_size {args.block_size} (best of {args.repeat})")
    for algo, rate in bench_hashing(args.hash_tokens, args.block_size, args.repeat).items():
        print(f"  {algo:9s} {rate / 1e6:7.2f} M tokens/s   {1e9 / rate:7.1f} us per 1000 tokens")

    print(f"\nper request, {args.prompt_tokens}-token prompt, block_size {args.block_size}, "
          f"best of {args.repeat} x {args.requests} requests")
    print("  find_cached_prefix + allocate_slots + free; decode = allocate_slots of 1 token")
    rows = [("xxh3_64", True), ("xxh3_128", True), ("sha256", True), ("xxh3_64", False)]
    for algo, caching in rows:
        r = bench_requests(args.prompt_tokens, args.block_size, algo, caching, args.requests,
                           args.repeat)
        label = f"{algo}, caching {'on' if caching else 'off'}"
        print(f"  {label:22s} cold {r['cold_us']:8.1f} us   warm {r['warm_us']:8.1f} us   "
              f"decode {r['decode_us']:6.2f} us")


if __name__ == "__main__":
    main()
