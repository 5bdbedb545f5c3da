"""`prefixserve demo`: the mission in one run.

Two workloads that repeat themselves, a long system prompt shared by ten
questions and a long document asked many questions, run once with prefix
caching and once without, on the same weights. Prints what each run computed,
what it reused, its time to first token and its total time, and checks that
the answers are identical.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from prefixserve.engine.llm import LLM
from prefixserve.entrypoints.demo_prompts import (DOC_QUESTIONS, QUESTIONS, SYSTEM_PROMPT,
                                                  build_document)
from prefixserve.entrypoints.engine_args import add_engine_args, engine_config_from_args
from prefixserve.sampling_params import SamplingParams


@dataclass
class RunResult:
    prompt_tokens: int
    computed_prompt_tokens: int
    cached_tokens: int
    ttft_p50: float
    total_s: float
    texts: list[list[int]]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="prefix caching on vs off on two repetitive workloads",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p, default_model="random:qwen3-0.6b")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per question")
    p.add_argument("--doc-paragraphs", type=int, default=12,
                   help="length of the long document (12 paragraphs: about 870 tokens)")
    p.set_defaults(func=run)


def _workloads(llm: LLM, doc_paragraphs: int) -> dict[str, list[list[int]]]:
    def chat(system: str, question: str) -> list[int]:
        return llm.tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": question}],
            add_generation_prompt=True, tokenize=True)
    document = build_document(doc_paragraphs)
    doc_system = "Answer questions about this manual.\n\n" + document
    return {
        f"system prompt, {len(QUESTIONS)} questions": [chat(SYSTEM_PROMPT, q) for q in QUESTIONS],
        f"document, {len(DOC_QUESTIONS)} questions": [chat(doc_system, q) for q in DOC_QUESTIONS],
    }


def _run_workload(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> RunResult:
    before = llm.stats()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    total = time.perf_counter() - start
    after = llm.stats()
    return RunResult(
        prompt_tokens=after.prompt_tokens - before.prompt_tokens,
        computed_prompt_tokens=after.computed_prompt_tokens - before.computed_prompt_tokens,
        cached_tokens=sum(o.num_cached_tokens for o in outs),
        ttft_p50=statistics.median(o.metrics.time_to_first_token for o in outs),
        total_s=total,
        texts=[o.outputs[0].token_ids for o in outs],
    )


def run(args: argparse.Namespace) -> int:
    # Wide enough for the table even when the output is not a terminal.
    console = Console(width=max(Console().width, 150))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    results: dict[tuple[str, bool], RunResult] = {}
    for caching in (True, False):
        config = engine_config_from_args(args, enable_prefix_caching=caching)
        label = "on" if caching else "off"
        with console.status(f"loading {config.model} (prefix caching {label})"):
            llm = LLM(**vars(config))
        for name, prompts in _workloads(llm, args.doc_paragraphs).items():
            with console.status(f"{name}, prefix caching {label}"):
                results[(name, caching)] = _run_workload(llm, prompts, params)
        del llm
        gc.collect()

    table = Table(title=f"prefix caching on vs off - {config.model}, greedy, {args.max_tokens} output tokens")
    for col in ("workload", "caching", "prompt tokens", "computed", "cache hits", "hit rate",
                "TTFT p50", "total", "speed-up"):
        table.add_column(col, justify="left" if col in ("workload", "caching") else "right",
                         no_wrap=True, min_width=len(col))
    all_same = True
    for name in dict.fromkeys(n for n, _ in results):
        on, off = results[(name, True)], results[(name, False)]
        same = on.texts == off.texts
        all_same &= same
        for caching, r in ((True, on), (False, off)):
            table.add_row(
                name if caching else "", "on" if caching else "off", str(r.prompt_tokens),
                str(r.computed_prompt_tokens), str(r.cached_tokens),
                f"{r.cached_tokens / r.prompt_tokens:.0%}", f"{r.ttft_p50 * 1000:.0f} ms",
                f"{r.total_s:.2f} s", f"{off.total_s / on.total_s:.2f}x" if caching else "")
        table.add_row("", "answers", "identical" if same else "DIFFERENT", "", "", "", "", "", "")
    console.print(table)
    if not all_same:
        console.print("[red]answers differ between prefix caching on and off[/red]")
        return 1
    console.print("Answers are token-for-token identical with and without prefix caching.")
    return 0
