"""Writes a model's exact weights to GGUF (same dtype) for llama.cpp, via the `gguf` package.

    python scripts/export_gguf.py --model random:qwen3-0.6b --dtype float32 [--out model.gguf]

A random:<preset> is first materialised as an HF checkpoint folder (the one
every benchmarked engine loads); a checkpoint folder is exported as it is.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from prefixserve.benchmarks.checkpoint import DEFAULT_CACHE_DIR, checkpoint_folder
from prefixserve.benchmarks.gguf_export import gguf_path_for


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="random:qwen3-0.6b")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    p.add_argument("--out", type=Path, help="copy the GGUF file here (default: print its cached path)")
    args = p.parse_args()
    folder = checkpoint_folder(args.model, args.dtype, args.seed, args.cache_dir)
    path = gguf_path_for(folder)
    if args.out:
        shutil.copyfile(path, args.out)
        path = args.out
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
