"""Command-line options shared by every subcommand that builds an engine."""
from __future__ import annotations

import argparse
import logging
from dataclasses import fields
from typing import Optional

from prefixserve.engine.config import (DEVICE_TYPES, DTYPES, EVICTION_POLICIES, HASH_ALGOS, KV_LAYOUTS,
                                       KV_STORE_WRITES, SCHEDULING_POLICIES, EngineConfig, parse_size)
from prefixserve.entrypoints.memory_size import SHARE_HELP, in_bytes, memory_size

logger = logging.getLogger(__name__)
_DEFAULTS = EngineConfig()


def byte_size(text: str) -> int:
    """An argparse type: bytes, with the units a store URL's ?size= takes (4GiB, 512MiB, 1.5GB)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_engine_args(parser: argparse.ArgumentParser, default_model: str, positional_model: bool = False) -> None:
    """positional_model: the model may also be named first, as `serve MODEL` (vLLM's spelling)."""
    if positional_model:
        parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                            help="the model, as --model takes it; give one of the two (default: --model)")
    # --model's own default is None, so that naming it and a positional MODEL can be told apart
    parser.set_defaults(default_model=default_model)
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help=f"local Hugging Face checkpoint folder or random:<preset> (default: {default_model})")
    g.add_argument("--dtype", default=_DEFAULTS.dtype, choices=DTYPES,
                   help="auto: bfloat16 on a CPU with AMX, or with avx512_bf16 where it multiplies bfloat16 "
                        "measurably faster, else float32; the checkpoint's "
                        "own dtype off the CPU (default: %(default)s)")
    g.add_argument("--device", default=_DEFAULTS.device,
                   help=f"torch device to run on: {', '.join(DEVICE_TYPES)}, optionally with an index "
                        "(cuda:1) (default: %(default)s)")
    g.add_argument("--attention-backend", default=_DEFAULTS.attention_backend,
                   help="a registered attention backend's name, or auto for the fastest that supports the "
                        "device and dtype (default: %(default)s)")
    g.add_argument("--seed", type=int, default=_DEFAULTS.seed,
                   help="seed of random:<preset> weights and of the sampler")
    g.add_argument("--block-size", type=int, default=_DEFAULTS.block_size, help="tokens per KV block")
    g.add_argument("--kv-layout", default=_DEFAULTS.kv_layout, choices=KV_LAYOUTS,
                   help="how the KV pool holds K/V: panels where the native attention tiles read them in "
                        "place (a bfloat16 model on a CPU with avx512_bf16, a float32 model on one with AVX-512; "
                        "block size and head dim multiples of 16), rows elsewhere (default: %(default)s)")
    g.add_argument("--enforce-eager", action="store_true", default=_DEFAULTS.enforce_eager,
                   help="run every step through the modules: on CUDA no decode graphs, on the CPU no native "
                        "decode loop")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=_DEFAULTS.enable_prefix_caching,
                   help="reuse the KV blocks of prompt prefixes computed before")
    # the older spelling, kept working; --help shows vLLM's
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help=argparse.SUPPRESS)
    g.add_argument("--hash-algo", default=_DEFAULTS.hash_algo, choices=HASH_ALGOS, help="block hash function")
    g.add_argument("--eviction-policy", default=_DEFAULTS.eviction_policy, choices=EVICTION_POLICIES,
                   help="which cached free block the pool reuses first")
    g.add_argument("--kv-cache-memory", type=memory_size, default=_DEFAULTS.kv_cache_memory, metavar="SIZE",
                   help="KV pool size: bytes, or with a unit (4GiB, 512MiB, 2GB), " + SHARE_HELP + " "
                        "(default: 4GiB on a CPU, capped at what --max-num-seqs full sequences use)")
    g.add_argument("--num-kv-blocks", type=int, default=_DEFAULTS.num_kv_blocks,
                   help="KV pool size in blocks; wins over --kv-cache-memory (default: from --kv-cache-memory)")
    g.add_argument("--max-num-batched-tokens", type=int, default=_DEFAULTS.max_num_batched_tokens,
                   help="tokens one engine step computes at most")
    g.add_argument("--max-num-seqs", type=int, default=_DEFAULTS.max_num_seqs,
                   help="sequences running at once at most")
    g.add_argument("--max-model-len", type=int, default=_DEFAULTS.max_model_len,
                   help="longest prompt plus output, in tokens (default: the model's limit, at most 32768)")
    g.add_argument("--scheduling-policy", default=_DEFAULTS.scheduling_policy, choices=SCHEDULING_POLICIES,
                   help="which waiting request runs next")
    g.add_argument("--fair-scheduling", action=argparse.BooleanOptionalAction, default=_DEFAULTS.fair_scheduling,
                   help="share the waiting queue by tenant weight, and each step and the running slots across the "
                        "tenants with work by their weighted served tokens (docs/tenants.md); off: one queue for "
                        "all (default: on)")
    g.add_argument("--tenant-cache-shares", action=argparse.BooleanOptionalAction,
                   default=_DEFAULTS.tenant_cache_shares,
                   help="keep each tenant's cached blocks above its weighted share of the pool against other "
                        "tenants' misses (docs/tenants.md); off: one eviction order for all (default: on)")
    g.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's own choice)")
    g.add_argument("--kv-store", dest="kv_stores", action="append", default=[], metavar="URL",
                   help="a KV store beneath the pool, repeatable, fastest first: mem://?size=8GiB, "
                        "file:///dir?size=100GiB, redis://host:6379/0 (docs/kv-stores.md) (default: none)")
    g.add_argument("--kv-store-write", default=_DEFAULTS.kv_store_write, choices=KV_STORE_WRITES,
                   help="write blocks to the stores when the pool evicts them (back) or once "
                        "computed (through) (default: %(default)s)")
    g.add_argument("--limit-mm-per-prompt", type=mm_limits, default={}, metavar="image=N",
                   help="most images one prompt may carry (default: no limit)")
    g.add_argument("--encoder-cache-bytes", type=byte_size, default=_DEFAULTS.encoder_cache_bytes, metavar="SIZE",
                   help="vision-tower outputs kept by image hash, least recently used out first "
                        "(default: 256MiB)")


def mm_limits(text: str) -> dict[str, int]:
    """"image=4" -> {"image": 4}."""
    limits = {}
    for item in filter(None, text.split(",")):
        kind, sep, count = item.partition("=")
        if kind.strip() != "image" or not sep or not count.strip().isdigit():
            raise argparse.ArgumentTypeError(f"expected image=N, got {item!r}")
        limits["image"] = int(count)
    return limits


def model_from_args(args: argparse.Namespace) -> str:
    """The model named by MODEL or --model, else the subcommand's default; both naming different
    models is an error."""
    positional: Optional[str] = getattr(args, "model_tag", None)
    if positional is not None and args.model is not None and positional != args.model:
        raise ValueError(f"two models given: {positional!r} (MODEL) and {args.model!r} (--model); "
                         "give one")
    return positional or args.model or args.default_model


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    if getattr(args, "threads", None):
        import torch
        torch.set_num_threads(args.threads)
    values = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
    values["model"] = model_from_args(args)
    if "kv_cache_memory" in values:
        values["kv_cache_memory"] = in_bytes(values["kv_cache_memory"], values.get("device", "cpu"),
                                             "--kv-cache-memory")
    values.update(overrides)
    return EngineConfig(**values)


def say_if_random(model: str, doing: str) -> None:
    """One start-up line where the weights are random: their outputs look like a broken model's."""
    from prefixserve.tokenizer.loader import RANDOM_MODEL_PREFIX

    if model.startswith(RANDOM_MODEL_PREFIX):
        logger.warning("%s random weights (%s): outputs are noise; pass a checkpoint folder for a real model",
                       doing, model)
