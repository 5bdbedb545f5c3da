"""The `prefixserve` command: one subcommand per module listed in COMMANDS."""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

from prefixserve.errors import PrefixServeError

# Each module defines add_parser(subparsers) and sets a `func(args) -> int` default.
COMMANDS = (
    "prefixserve.entrypoints.demo",
    "prefixserve.entrypoints.generate",
    "prefixserve.diagnose.cli",
    "prefixserve.entrypoints.serve",
    "prefixserve.benchmarks.cli",
    "prefixserve.entrypoints.kv_store",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixserve",
        description="LLM inference with a paged KV cache and automatic prefix caching.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (PrefixServeError, ValueError, FileNotFoundError) as exc:
        print(f"prefixserve {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
