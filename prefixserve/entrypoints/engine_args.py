"""Command-line options shared by every subcommand that builds an engine."""
from __future__ import annotations

import argparse
from dataclasses import fields

from prefixserve.engine.config import (DEVICE_TYPES, DTYPES, EVICTION_POLICIES, HASH_ALGOS, KV_LAYOUTS,
                                       KV_STORE_WRITES, SCHEDULING_POLICIES, EngineConfig)


def add_engine_args(parser: argparse.ArgumentParser, default_model: str) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=default_model,
                   help="local Hugging Face checkpoint folder or random:<preset> (default: %(default)s)")
    g.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="auto: bfloat16 on a CPU with AMX, or with avx512_bf16 where it multiplies bfloat16 "
                        "measurably faster, else float32; the checkpoint's "
                        "own dtype off the CPU (default: %(default)s)")
    g.add_argument("--device", default="cpu",
                   help=f"torch device to run on: {', '.join(DEVICE_TYPES)}, optionally with an index "
                        "(cuda:1) (default: %(default)s)")
    g.add_argument("--attention-backend", default="auto",
                   help="a registered attention backend's name, or auto for the fastest that supports the "
                        "device and dtype (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-layout", default="auto", choices=KV_LAYOUTS,
                   help="how the KV pool holds K/V: panels where the native attention tiles read them in "
                        "place (a bfloat16 model on a CPU with avx512_bf16, a float32 model on one with AVX-512; "
                        "block size and head dim multiples of 16), rows elsewhere (default: %(default)s)")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--hash-algo", default="xxh3_64", choices=HASH_ALGOS)
    g.add_argument("--eviction-policy", default="lru", choices=EVICTION_POLICIES)
    g.add_argument("--kv-cache-memory", type=int, default=None, help="KV pool size in bytes")
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--scheduling-policy", default="fcfs", choices=SCHEDULING_POLICIES)
    g.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    g.add_argument("--kv-store", dest="kv_stores", action="append", default=[], metavar="URL",
                   help="a KV store beneath the pool, repeatable, fastest first: mem://?size=8GiB, "
                        "file:///dir?size=100GiB, redis://host:6379/0 (docs/kv-stores.md)")
    g.add_argument("--kv-store-write", default="back", choices=KV_STORE_WRITES,
                   help="write blocks to the stores when the pool evicts them (back) or once "
                        "computed (through) (default: %(default)s)")


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    if getattr(args, "threads", None):
        import torch
        torch.set_num_threads(args.threads)
    values = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
    values.update(overrides)
    return EngineConfig(**values)
