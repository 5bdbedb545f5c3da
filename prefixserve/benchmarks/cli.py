"""`prefixserve bench`: workloads x engines on one checkpoint, against the machine's measured limits."""
from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from prefixserve.benchmarks.checkpoint import DEFAULT_CACHE_DIR
from prefixserve.benchmarks.engines import ENGINE_NAMES
from prefixserve.benchmarks.kv_store_bench import STORE_WORKLOADS
from prefixserve.benchmarks.tenants_flood import WORKLOAD as TENANTS_FLOOD
from prefixserve.benchmarks.workloads import WORKLOAD_NAMES
from prefixserve.engine.config import DTYPES


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark prefixserve against baselines and the machine's limits",
                       description="Runs fixed-seed workloads on prefixserve, HF transformers (padded batch; "
                                   "hand-written prefix reuse) and llama.cpp when installed, all on the same "
                                   "weights and dtype, and prints a markdown table.")
    p.add_argument("--model", default="random:qwen3-0.6b",
                   help="random:<preset> or a local HF checkpoint folder (default: %(default)s)")
    p.add_argument("--dtype", action="append", choices=[d for d in DTYPES if d != "auto"],
                   help="repeatable: the whole benchmark runs once per dtype, each against the machine's limits "
                        "measured in that dtype (default: float32)")
    p.add_argument("--workload", action="append",
                   choices=WORKLOAD_NAMES + STORE_WORKLOADS + ("image-qa", TENANTS_FLOOD), metavar="NAME",
                   help=f"repeatable; default: all of {', '.join(WORKLOAD_NAMES)}; the KV store workloads "
                        f"{', '.join(STORE_WORKLOADS)} run only when named (prefixserve/benchmarks/kv_store_bench.py), "
                        f"and so does {TENANTS_FLOOD}, a quiet tenant under another's flood on a real server "
                        "(prefixserve/benchmarks/tenants_flood.py); image-qa runs alone, on a "
                        "random:qwen2.5-vl-* model (prefixserve/benchmarks/image_qa.py)")
    p.add_argument("--engine", action="append", choices=ENGINE_NAMES, metavar="NAME",
                   help=f"repeatable; default: all of {', '.join(ENGINE_NAMES)}")
    p.add_argument("--quick", action="store_true", help="small workloads (a few minutes on 2 cores)")
    p.add_argument("--json", type=Path, metavar="OUT", help="write every figure and request record as JSON")
    p.add_argument("--plot", type=Path, metavar="DIR", help="write PNG charts into DIR")
    p.add_argument("--markdown", type=Path, metavar="OUT", help="also write the markdown report to OUT")
    p.add_argument("--threads", type=int, default=2, help="torch and llama.cpp threads (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of random:<preset> weights")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR,
                   help="where exported checkpoints (safetensors, GGUF) are kept (default: %(default)s)")
    p.add_argument("--llama-kv-f16", action="store_true", help="llama.cpp's default float16 KV instead of float32")
    p.add_argument("--online", metavar="URL", help="instead: send the workloads to a running OpenAI-compatible "
                                                    "server (e.g. http://127.0.0.1:8000)")
    p.add_argument("--rate", type=float, default=1.0, help="online mode: Poisson arrival rate, requests/s")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    if args.workload and "image-qa" in args.workload:
        return _run_image_qa(args)
    if TENANTS_FLOOD in (args.workload or ()):
        return _run_tenants_flood(args, console)
    store_workloads = tuple(w for w in args.workload or () if w in STORE_WORKLOADS)
    if store_workloads:
        return _run_store_workloads(args, store_workloads,
                                    tuple(w for w in args.workload if w not in STORE_WORKLOADS))
    workloads = tuple(args.workload or WORKLOAD_NAMES)
    if args.online:
        return _run_online(args, workloads, console)
    from prefixserve.benchmarks.report import dtype_comparison_md, to_markdown, write_json, write_plots
    from prefixserve.benchmarks.runner import BenchConfig, run_benchmark
    dtypes = _dtypes(args)
    texts, by_dtype = [], {}
    for dtype in dtypes:
        config = BenchConfig(model=args.model, dtype=dtype, workloads=workloads,
                             engines=tuple(args.engine or ENGINE_NAMES), quick=args.quick, threads=args.threads,
                             seed=args.seed, cache_dir=args.cache_dir, llama_kv_f32=not args.llama_kv_f16)
        results = by_dtype[dtype] = run_benchmark(config, console)
        texts.append(to_markdown(results))
        print(texts[-1])
        # one file or folder per dtype when there are several
        suffix = f"-{dtype}" if len(dtypes) > 1 else ""
        if args.json:
            write_json(results, args.json.with_name(f"{args.json.stem}{suffix}{args.json.suffix}"))
        if args.plot:
            for path in write_plots(results, args.plot / dtype if suffix else args.plot):
                console.print(f"wrote {path}")
    if "float32" in by_dtype and "bfloat16" in by_dtype:
        texts.append(dtype_comparison_md(by_dtype["float32"], by_dtype["bfloat16"]))
        print(texts[-1])
    _write_report(args, "\n\n".join(texts))
    return 0


def _write_report(args: argparse.Namespace, text: str, data: object = None) -> None:
    """--markdown gets the printed text, --json the figures (when the workload has them)."""
    import json

    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text + "\n")
    if args.json and data is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=1, default=str) + "\n")


def _run_image_qa(args: argparse.Namespace) -> int:
    """image-qa runs on its own: it needs a vision-language model (default random:qwen2.5-vl-tiny)."""
    from prefixserve.benchmarks.image_qa import image_qa_markdown
    model = args.model if args.model.startswith("random:qwen2.5-vl") else "random:qwen2.5-vl-tiny"
    text = image_qa_markdown(model, args.quick, args.threads, args.seed)
    print(text)
    _write_report(args, text)
    return 0


def _dtypes(args: argparse.Namespace) -> list[str]:
    return list(dict.fromkeys(args.dtype or ["float32"]))


def _run_store_workloads(args: argparse.Namespace, store_workloads: tuple[str, ...],
                         others: tuple[str, ...]) -> int:
    from prefixserve.benchmarks.kv_store_bench import StoreBenchConfig, run_store_benchmarks
    if others or args.online:
        raise ValueError(f"run the KV store workloads ({', '.join(store_workloads)}) on their own, "
                         "offline: each starts its own engines and processes")
    dtypes = _dtypes(args)
    if len(dtypes) > 1:
        raise ValueError("the KV store workloads run in one dtype at a time")
    config = StoreBenchConfig(model=args.model, dtype=dtypes[0], quick=args.quick, threads=args.threads,
                              seed=args.seed, workdir=args.cache_dir)
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    text, data = run_store_benchmarks(config, store_workloads)
    print(text)
    _write_report(args, text, data)
    return 0


def _run_tenants_flood(args: argparse.Namespace, console: Console) -> int:
    from prefixserve.benchmarks.tenants_flood import FloodConfig, run_tenants_flood
    if len(args.workload) > 1 or args.online:
        raise ValueError(f"run {TENANTS_FLOOD} on its own: it starts its own servers")
    # seven servers one after another: unless a model is named, the tiny one, not the bench's default
    model = args.model if args.model != "random:qwen3-0.6b" else FloodConfig.model
    config = FloodConfig(model=model, threads=args.threads, seed=args.seed,
                         duration_s=5.0 if args.quick else FloodConfig.duration_s)
    text, data = run_tenants_flood(config, log=console.print)
    print(text)
    _write_report(args, text, data)
    return 0


def _run_online(args: argparse.Namespace, workloads: tuple[str, ...], console: Console) -> int:
    import json

    from rich.progress import Progress

    from prefixserve.benchmarks.figures import figures_of
    from prefixserve.benchmarks.online import run_online
    from prefixserve.benchmarks.workloads import build_workload
    figs = []
    with Progress(console=console) as progress:
        for name in workloads:
            w = build_workload(name, args.quick)
            task = progress.add_task(f"{args.online} · {name}", total=len(w.requests))
            run = run_online(args.online, w, args.rate, on_done=lambda: progress.advance(task))
            figs.append(figures_of(run, w))
    lines = [f"Online: {args.online}, Poisson arrivals at {args.rate:g} requests/s.", "",
             "| workload | wall s | req/s | out tok/s | hit rate | TTFT p50 / p90 ms | TPOT p50 ms |",
             "|---|---|---|---|---|---|---|"]
    for f in figs:
        tpot = "–" if f.tpot_p50_s is None else f"{f.tpot_p50_s * 1000:.0f}"
        lines.append(f"| {f.workload} | {f.wall_s:.2f} | {f.requests_per_s:.2f} | {f.output_tokens_per_s:.1f} | "
                     f"{f.cache_hit_rate:.0%} | {f.ttft_p50_s * 1000:.0f} / {f.ttft_p90_s * 1000:.0f} | {tpot} |")
    print("\n".join(lines))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"url": args.online, "rate": args.rate,
                                         "figures": [f.as_dict() for f in figs]}, indent=1) + "\n")
    return 0
