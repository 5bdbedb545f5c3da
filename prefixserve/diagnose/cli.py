"""`prefixserve lint` and `prefixserve replay`: cache-miss diagnosis of request logs."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from prefixserve.diagnose.lint import lint, to_replay
from prefixserve.diagnose.lint_report import FORMATS, format_lint
from prefixserve.diagnose.log_reader import LogRecord, read_log
from prefixserve.diagnose.render import load_renderer
from prefixserve.diagnose.replay import ReplayConfig, blocks_needed, replay, unbounded_num_blocks
from prefixserve.diagnose.replay_report import format_replay, plot_replay
from prefixserve.diagnose.rules import RULE_IDS
from prefixserve.kv.config import EVICTION_POLICIES

DEFAULT_MODEL = "random:qwen3-tiny"
# Default sweep: these fractions of the pool that would never evict.
SWEEP_FRACTIONS = (1 / 128, 1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1)

LOG_HELP = ("JSONL of OpenAI chat-completion or completion request bodies, or records "
            '{"body": {...}, "timestamp", "tenant", "cache_salt", "response"}')


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lint", help="explain why a request log misses the prefix cache",
                       description="Renders each logged request through the model's chat template "
                       "and tokenizer, finds where it stops sharing tokens with the closest "
                       "earlier request, names the cause (rules) and simulates the fixes.")
    p.add_argument("log", help=LOG_HELP)
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="checkpoint folder or random:<preset> whose tokenizer and chat template to use")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--format", choices=FORMATS, default="text")
    p.add_argument("--output", help="write the report here instead of stdout")
    p.add_argument("--fail-on", default="",
                   help=f"comma-separated rule ids (or 'all'): exit 1 if any fires. Rules: {', '.join(RULE_IDS)}")
    p.set_defaults(func=run_lint)

    p = sub.add_parser("replay", help="replay a request log through the KV cache at several sizes",
                       description="Serves the logged requests one at a time through prefixserve.kv "
                       "(the engine's block bookkeeping) for each cache configuration and reports "
                       "hit rate, tokens saved and evictions.")
    p.add_argument("log", help=LOG_HELP)
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="checkpoint folder or random:<preset> whose tokenizer and chat template to use")
    p.add_argument("--cache-blocks", type=int, nargs="+",
                   help="pool sizes in blocks (default: 1/64 .. 1x of a pool that never evicts)")
    p.add_argument("--block-size", type=int, nargs="+", default=[16])
    p.add_argument("--eviction", nargs="+", choices=EVICTION_POLICIES, default=["lru"])
    p.add_argument("--plot", help="write a PNG of hit rate against cache size here")
    p.add_argument("--format", choices=FORMATS, default="text")
    p.set_defaults(func=run_replay)


def parse_fail_on(value: str) -> set[str]:
    names = {n.strip() for n in value.split(",") if n.strip()}
    if "all" in names:
        return set(RULE_IDS)
    unknown = names - set(RULE_IDS)
    if unknown:
        raise ValueError(f"--fail-on: unknown rule(s) {', '.join(sorted(unknown))}; "
                         f"known: {', '.join(RULE_IDS)}, all")
    return names


def other_models(records: list[LogRecord], model: str) -> dict[str, int]:
    """The models the log's bodies name that are not `model` (a folder matches its name), with
    how many requests name each: their tokens would be counted with the wrong tokenizer."""
    same = {model, Path(model).name}
    found: dict[str, int] = {}
    for record in records:
        if record.model is not None and record.model not in same and Path(record.model).name not in same:
            found[record.model] = found.get(record.model, 0) + 1
    return found


def warn_other_models(records: list[LogRecord], model: str) -> None:
    others = other_models(records, model)
    if others:
        named = ", ".join(f"{name!r} ({count} requests)" for name, count in sorted(others.items()))
        print(f"prefixserve: warning: the log names {named}, but tokens are counted with the tokenizer and "
              f"chat template of {model!r}; pass --model with the log's model for exact figures",
              file=sys.stderr)


def run_lint(args: argparse.Namespace) -> int:
    fail_on = parse_fail_on(args.fail_on)
    records = read_log(args.log)
    warn_other_models(records, args.model)
    report = lint(records, load_renderer(args.model), block_size=args.block_size,
                  source=str(args.log), model=args.model)
    text = format_lint(report, args.format)
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    fired = fail_on & set(report.fired())
    if fired:
        print(f"prefixserve lint: failing on {', '.join(sorted(fired))}", file=sys.stderr)
        return 1
    return 0


def run_replay(args: argparse.Namespace) -> int:
    for size in args.block_size:
        if size <= 0:
            raise ValueError(f"--block-size must be > 0, got {size}")
    if args.cache_blocks and any(n <= 0 for n in args.cache_blocks):
        raise ValueError(f"--cache-blocks must be > 0, got {args.cache_blocks}")
    renderer = load_renderer(args.model)
    records = read_log(args.log)
    warn_other_models(records, args.model)
    requests = to_replay([renderer.render(r) for r in records])
    results = []
    for block_size in args.block_size:
        full = unbounded_num_blocks(requests, block_size)
        # The default sweep starts where the largest request still fits.
        largest = max(blocks_needed(r, block_size) for r in requests)
        sizes = args.cache_blocks or sorted({max(largest, round(full * f)) for f in SWEEP_FRACTIONS})
        for policy in args.eviction:
            for num_blocks in sizes:
                results.append(replay(requests, ReplayConfig(num_blocks, block_size, policy)))
    sys.stdout.write(format_replay(results, args.format))
    if args.plot:
        path = plot_replay(results, args.plot, title=f"{Path(args.log).name}: hit rate vs cache size")
        print(f"plot written to {path}", file=sys.stderr)
    return 0
