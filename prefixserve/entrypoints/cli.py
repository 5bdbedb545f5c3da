"""The `prefixserve` command: one subcommand per module listed in COMMANDS."""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

from prefixserve import __version__
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


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in --help: appended where its help does not already speak of it
    (in words, where the value alone would read as None)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        if "default" in help.lower():
            return help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    def __init__(self, **kwargs) -> None:
        kwargs["formatter_class"] = HelpFormatter
        super().__init__(**kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="prefixserve",
                     description="LLM inference with a paged KV cache and automatic prefix caching.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
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
