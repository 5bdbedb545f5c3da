"""Shared by the KV store tests: prompts larger than a small pool, the caching-off oracle, and
engines run in child processes (a restart, or a second process on the same store).

The model is the tiny Qwen3 checkpoint of checkpoint_factory (wide random weights), not
random:qwen3-tiny: the latter's greedy outputs do not change even with every K/V value
negated, so they could not tell a wrong block from a right one.
"""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

from prefixserve import LLM, SamplingParams

BLOCK = 16
POOL_BLOCKS = 16          # holds about two of the documents below
PARAMS = SamplingParams(max_tokens=6, temperature=0.0)


def documents(n: int = 6, length: int = 100, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 4000) for _ in range(length)] for _ in range(n)]


def reference(prompts: list[list[int]], model: str) -> list[list[int]]:
    """Greedy outputs with prefix caching off: what every cached run must reproduce."""
    llm = LLM(model, dtype="float32", enable_prefix_caching=False, num_kv_blocks=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    return [o.outputs[0].token_ids for o in outs]


def full_blocks(prompt: list[int]) -> int:
    """Tokens a lookup can hit: full blocks, never the block of the last token."""
    return (len(prompt) - 1) // BLOCK * BLOCK


def blocks_cached_after(prompt: list[int]) -> int:
    """Full blocks a request leaves in the cache: its prompt and the outputs fed back."""
    return (len(prompt) + PARAMS.max_tokens - 1) // BLOCK


_CHILD = """
import json, sys
from prefixserve import LLM, SamplingParams
args = json.loads(sys.argv[1])
llm = LLM(args["model"], dtype="float32", num_kv_blocks=args["blocks"], kv_stores=args["stores"])
if args.get("fsize"):
    # A full disk, as the OS reports it: every write past this size fails with EFBIG.
    import resource, signal
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (args["fsize"], args["fsize"]))
params = SamplingParams(max_tokens=6, temperature=0.0)
result = []
for _ in range(args.get("rounds", 1)):
    for p in args["prompts"]:
        out = llm.generate({"prompt_token_ids": p}, params)[0]
        result.append([out.num_cached_tokens, out.outputs[0].token_ids])
stats = [vars(s) for s in llm.stats().kv_stores]
print(json.dumps({"result": result, "stats": stats}))
if args.get("close"):
    llm.close()
# Otherwise the interpreter's exit flushes the pool to the persistent stores.
"""


def run_child(prompts, stores, *, model: str, blocks: int = 64, close: bool = False,
              rounds: int = 1, fsize: int = 0, timeout: float = 300) -> dict:
    arg = json.dumps({"model": model, "prompts": prompts, "stores": stores, "blocks": blocks,
                      "close": close, "rounds": rounds, "fsize": fsize})
    proc = subprocess.run([sys.executable, "-c", _CHILD, arg], capture_output=True, text=True,
                          timeout=timeout, cwd=Path(__file__).parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
