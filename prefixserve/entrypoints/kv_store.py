"""`prefixserve kv-store stats|ls|clear URL`: look into and empty a KV store."""
from __future__ import annotations

import argparse

from prefixserve.engine.kv_store_admin import clear_store, store_records, store_usage


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kv-store", help="look into or empty a KV store (file:// or redis://)",
                       description=__doc__)
    p.add_argument("action", choices=("stats", "ls", "clear"))
    p.add_argument("url", help="file:///dir or redis://host:port/db")
    p.add_argument("--scope", default=None,
                   help="only the records of this key scope (a hex digest that stats lists)")
    p.add_argument("--limit", type=int, default=100, help="ls: most records shown (default: %(default)s)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.action == "stats":
        usage = store_usage(args.url)
        if args.scope is not None:
            usage = [u for u in usage if u.scope == args.scope]
        print(f"{'scope':34} {'records':>9} {'bytes':>14}")
        for u in usage:
            print(f"{u.scope:34} {u.records:9d} {u.bytes:14d}")
        print(f"{'total':34} {sum(u.records for u in usage):9d} {sum(u.bytes for u in usage):14d}")
    elif args.action == "ls":
        if args.limit < 0:
            raise ValueError("--limit must be >= 0")
        records = store_records(args.url, args.scope)
        for key, size in records[:args.limit]:
            print(f"{key} {size}")
        if len(records) > args.limit:
            print(f"... {len(records) - args.limit} more")
    else:
        print(f"deleted {clear_store(args.url, args.scope)} records")
    return 0
