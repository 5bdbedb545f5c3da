"""The benchmark's results as a markdown report, a JSON document and matplotlib figures."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional

from prefixserve.benchmarks.dtype_comparison import amx_target, speedups
from prefixserve.benchmarks.figures import Figures, figures_of, output_agreement
from prefixserve.benchmarks.limits import MachineLimits, batched_decode_bound_s, ideal_decode_steps_per_s, \
    ideal_prefill_tokens_per_s, ideal_workload_seconds
from prefixserve.benchmarks.runner import BenchResults
from prefixserve.benchmarks.serving_memory import ServingMemory, memory_target
from prefixserve.benchmarks.targets import Target, evaluate_targets

ENGINE_ORDER = ("prefixserve", "prefixserve-warm", "prefixserve-nocache", "prefixserve-unsalted", "hf-padded",
                "hf-reuse", "llama.cpp", "llama.cpp-q8_0")


def _engine_key(name: str) -> int:
    return ENGINE_ORDER.index(name) if name in ENGINE_ORDER else len(ENGINE_ORDER)


def all_figures(res: BenchResults) -> list[Figures]:
    limits = res.best_limits()
    figs = [figures_of(r, res.workloads[r.workload], res.cost, limits) for r in res.runs]
    return sorted(figs, key=lambda f: (list(res.workloads).index(f.workload), _engine_key(f.engine)))


def targets_of(res: BenchResults) -> list[Target]:
    ideal = {name: w.ideal_computed_tokens() for name, w in res.workloads.items()}
    best = res.best_limits()

    def seconds(limits_of) -> dict[str, float]:
        return {name: ideal_workload_seconds(w, res.cost, limits_of(name))["total_s"]
                for name, w in res.workloads.items()}

    return (evaluate_targets(res.runs, ideal, res.roofline, decode_bounds(res, res.limits_around), res.config.dtype,
                             seconds(res.limits_around), decode_bounds(res, lambda _: best), seconds(lambda _: best))
            + [memory_target(res.serving_memory)])


def decode_bounds(res: BenchResults, limits_of: Callable[[str], MachineLimits]) -> dict[str, float]:
    """Per workload whose requests all share one prefix and arrive in one round: the batched-decode
    step's bound (limits.batched_decode_bound_s, at the limits `limits_of(workload)`) halfway through
    the outputs, in seconds."""
    out = {}
    for name, w in res.workloads.items():
        if len(w.rounds) != 1 or len(w.rounds[0]) < 2:
            continue
        rnd = w.rounds[0]
        shared = min(r.shared_prefix_len for r in rnd)
        if shared == 0:
            continue
        step = max(r.max_tokens for r in rnd) // 2
        contexts = [len(r.prompt_token_ids) + step for r in rnd]
        out[name] = batched_decode_bound_s(res.cost, limits_of(name), contexts, shared)
    return out


def _run(res: BenchResults, engine: str, workload: str):
    return next((r for r in res.runs if r.engine == engine and r.workload == workload), None)


def _f(x: Optional[float], digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _ms(x: Optional[float]) -> str:
    return "–" if x is None else f"{x * 1000:.0f}"


def _features(machine: dict) -> str:
    # results written before the features were recorded have none
    return f" ({machine['cpu_features']})" if machine.get("cpu_features") else ""


def to_markdown(res: BenchResults) -> str:
    c, m, lim, cost = res.config, res.machine, res.limits, res.cost
    lines = [f"Model `{c.model}` ({cost.body_params / 1e6:.1f}M body parameters, vocabulary "
             f"{cost.config.vocab_size}), dtype **{c.dtype}**, {'quick' if c.quick else 'full'} workloads. "
             f"Machine: {m['cpu']}{_features(m)}, {m['logical_cpus']} logical CPUs, {m['threads']} torch threads, "
             f"torch "
             f"{m['torch']}. The whole run took {res.seconds / 60:.1f} min.", ""]
    lines += ["## The machine's limits (measured in this run)", "",
              "| figure | value |", "|---|---|"]
    for n, flops in sorted(lim.matmul_by_size.items()):
        lines.append(f"| matmul {lim.dtype}, n = {n} (faster of torch.mm and the projections' kernel), at the start | "
                     f"{flops / 1e9:.1f} GFLOP/s |")
    lines.append(f"| memory bandwidth (sum over {'256 MiB' if c.quick else '1 GiB'}), at the start | "
                 f"{lim.bandwidth_bytes / 1e9:.1f} GB/s |")
    best = res.best_limits()
    lines.append("| best of every reading in the run (at the start, around the single-request rounds, the "
                 "batched-decode steps' median, around prefixserve's long-doc-qa runs), which the workloads' ideal "
                 "times below are set against "
                 f"| {best.matmul_flops / 1e9:.1f} GFLOP/s, {best.bandwidth_bytes / 1e9:.1f} GB/s |")
    if any("limits_around" in r.extra for r in res.runs if r.workload == "long-doc-qa"):
        around = res.limits_around("long-doc-qa")
        lines.append(f"| read just before and just after prefixserve's kept long-doc-qa run, the better of each, "
                     f"which its fraction-of-ideal target is set against (its TPOT p50 is reported against them) | "
                     f"{around.matmul_flops / 1e9:.1f} GFLOP/s, {around.bandwidth_bytes / 1e9:.1f} GB/s |")
    lines.append(f"| ideal prefill, 512-token prompt | {ideal_prefill_tokens_per_s(cost, best, 512):.0f} tokens/s |")
    lines.append(f"| ideal batch-1 decode (context 80) | {ideal_decode_steps_per_s(cost, best, [80]):.1f} steps/s |")
    lines.append("")
    lines += _roofline_md(res.roofline)
    lines += _targets_md(targets_of(res))
    lines += _serving_memory_md(res.serving_memory)
    lines += _workloads_md(res)
    if res.skipped:
        lines += ["## Engines not run", ""] + [f"- **{e}**: {why}" for e, why in res.skipped.items()] + [""]
    return "\n".join(lines)


def dtype_comparison_md(float32: BenchResults, bfloat16: BenchResults) -> str:
    """prefixserve's wall time per workload in both dtypes of one run, and the AMX target."""
    lines = ["## bfloat16 against float32", "",
             "prefixserve (cold, cache on) per workload, the runs of each dtype's part of this page.", "",
             "| workload | float32 wall s | bfloat16 wall s | bfloat16 speed-up |", "|---|---|---|---|"]
    lines += [f"| {s.workload} | {_seconds(s.float32_s)} | {_seconds(s.bfloat16_s)} | {s.speedup:.2f}x |"
              for s in speedups(float32, bfloat16)]
    target = amx_target(float32, bfloat16)
    return "\n".join(lines + [""] + _targets_table([target]) + [f"{target.name}: {target.detail}."])


def _seconds(x: float) -> str:
    """Two decimals, or three significant digits under a second (a quick run's)."""
    return f"{x:.2f}" if x >= 1 else f"{x:.3g}"


def _roofline_md(roof: dict) -> list[str]:
    if not roof:
        return []
    p, d, w = roof["prefill"], roof["decode_b1"], roof["warm_ttft"]
    return ["## prefixserve against the limits", "", "| measurement | measured | ideal | fraction |",
            "|---|---|---|---|",
            f"| prefill, {p['tokens']}-token prompt | {p['tokens_per_s']:.0f} tok/s | {p['ideal_tokens_per_s']:.0f} "
            f"tok/s (at {p['matmul_flops'] / 1e9:.0f} GFLOP/s, the best reading around its rounds) | "
            f"{p['fraction']:.0%} |",
            f"| batch-1 decode (median of {d['steps']} steps) | {d['steps_per_s']:.2f} steps/s | "
            f"{d['ideal_steps_per_s']:.2f} steps/s (its bound at limits read just before each step, median "
            f"reading {d['bandwidth_bytes'] / 1e9:.1f} GB/s) | {d['fraction']:.0%} (median of the paired ratios) |",
            f"| TTFT, {w['prefix_tokens']} cached + {w['suffix_tokens']} new tokens | {w['warm_ttft_s'] * 1000:.0f} ms "
            f"| {w['suffix_only_ttft_s'] * 1000:.0f} ms (the {w['suffix_tokens']} tokens alone) | "
            f"{w['ratio']:.2f}x |"] + _batched_decode_md(roof.get("batched_decode")) + [""]


def _batched_decode_md(b: Optional[dict]) -> list[str]:
    if not b:
        return []
    return [f"| batched decode, {b['sequences']} sequences over {b['shared_tokens']} shared tokens (median of "
            f"{b['steps']} steps) | {b['step_s'] * 1000:.1f} ms a step | its bound at limits read just before "
            f"each step (median reading {b['matmul_flops'] / 1e9:.0f} GFLOP/s, {b['bandwidth_bytes'] / 1e9:.1f} "
            f"GB/s) | {b['ratio']:.2f}x |"]


def _targets_md(targets: list[Target]) -> list[str]:
    return ["## Targets", ""] + _targets_table(targets)


def _targets_table(targets: list[Target]) -> list[str]:
    lines = ["| target | wanted | measured | verdict |", "|---|---|---|---|"]
    for t in targets:
        verdict = "reported" if t.met is None and t.measured is not None else (
            "not measured" if t.met is None else ("**met**" if t.met else "**not met**"))
        lines.append(f"| {t.name} | {t.wanted} | {_f(t.measured)} | {verdict} |")
    return lines + [""]


def _serving_memory_md(memory: Optional[ServingMemory]) -> list[str]:
    if memory is None:
        return []
    mib = 1 << 20
    return ["## Serving process memory", "",
            f"One `prefixserve serve` process, started as a user starts it on the same checkpoint, dtype, threads "
            f"and KV pool, served {memory.workload} ({memory.requests} requests over HTTP); its peak is the "
            f"process's resident high-water mark over its whole life, loading included.", "",
            "| figure | MiB |", "|---|---|",
            f"| peak RSS of the serving process | {memory.peak_rss_bytes / mib:.0f} |",
            f"| weights (parameters and buffers) | {memory.weights_bytes / mib:.0f} |",
            f"| KV pool | {memory.kv_cache_bytes / mib:.0f} |",
            f"| budget: weights + KV pool + 1 GiB | {memory.budget_bytes / mib:.0f} |",
            f"| peak / budget | {memory.ratio:.2f}x |", ""]


def _workloads_md(res: BenchResults) -> list[str]:
    figs = all_figures(res)
    lines = ["## Workloads", "",
             "Columns: wall time; requests/s and output tokens/s over the wall time; prompt tokens pushed through "
             "the model (padding included for HF) against the ideal (each distinct prefix once); cache hit rate "
             "(prompt tokens served from a cache); time to first token p50/p90 and time per output token p50, "
             "measured from the arrival of the request's round; peak resident memory of the bench process during "
             "the run (for prefixserve's runs on the default pool it holds both the cache-on and the cache-off "
             "engine, each with its weights and KV pool; one server's figure is under Serving process memory); "
             "the fraction of the ideal time reached (only uncached tokens at the matmul peak, each round "
             "decoded as one batch at the bandwidth limit); speed-up over HF's padded batch.", ""]
    limits = res.best_limits()
    for name, w in res.workloads.items():
        ideal = ideal_workload_seconds(w, res.cost, limits)
        lines += [f"### {name}", "", f"{w.description}. Seed {w.seed}. {w.prompt_tokens} prompt tokens, ideal "
                  f"{w.ideal_computed_tokens()} computed; ideal time {ideal['total_s']:.2f} s "
                  f"(prefill {ideal['prefill_s']:.2f} s + decode {ideal['decode_s']:.2f} s).", "",
                  "| engine | wall s | req/s | out tok/s | prompt tok computed | hit rate | TTFT p50 / p90 ms | "
                  "TPOT p50 ms | peak RSS MiB | % of ideal | vs HF padded |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        base = _run(res, "hf-padded", name)
        for f in (f for f in figs if f.workload == name):
            speedup = f"{base.wall_s / f.wall_s:.2f}x" if base else "–"
            lines.append(f"| {f.engine} | {f.wall_s:.2f} | {f.requests_per_s:.2f} | {f.output_tokens_per_s:.1f} | "
                         f"{f.computed_prompt_tokens} ({f.computed_prompt_tokens / f.ideal_computed_tokens:.2f}x) | "
                         f"{f.cache_hit_rate:.0%} | {_ms(f.ttft_p50_s)} / {_ms(f.ttft_p90_s)} | {_ms(f.tpot_p50_s)} | "
                         f"{f.peak_rss_mib:.0f} | {f.fraction_of_ideal:.0%} | {speedup} |")
        lines += [""] + _agreement_md(res, name) + _tenants_md(res, w) + _skips_md(res, w)
    return lines


def _agreement_md(res: BenchResults, name: str) -> list[str]:
    ref = _run(res, "prefixserve", name)
    if ref is None:
        return []
    parts = []
    for other in ("prefixserve-nocache", "prefixserve-warm", "hf-padded", "hf-reuse", "llama.cpp", "llama.cpp-q8_0"):
        run = _run(res, other, name)
        if run is not None:
            same, n = output_agreement(ref, run)
            parts.append(f"{other} {same}/{n}")
    if not parts:
        return []
    return ["Greedy outputs identical to prefixserve's (cold, cache on): " + ", ".join(parts) + ".", ""]


def _tenants_md(res: BenchResults, w) -> list[str]:
    salted, unsalted = _run(res, "prefixserve", w.name), _run(res, "prefixserve-unsalted", w.name)
    if w.name != "tenants" or salted is None or unsalted is None:
        return []
    extra = salted.computed_prompt_tokens - unsalted.computed_prompt_tokens
    forbidden = (w.notes["tenants"] - 1) * w.notes["shared_prefix_len"]
    return [f"Isolation cost: with salts prefixserve computed {salted.computed_prompt_tokens} prompt tokens, without "
            f"{unsalted.computed_prompt_tokens}: {extra} more, against the {forbidden} tokens of shared system "
            f"prompt that {w.notes['tenants'] - 1} extra tenants may not share "
            f"({'exactly' if extra == forbidden else 'not exactly'} the sharing isolation forbids).", ""]


def _skips_md(res: BenchResults, w) -> list[str]:
    skipped = [e for e in w.skip_engines if e in res.config.engines]
    if not skipped:
        return []
    return [f"Not run here: {', '.join(skipped)} (the order of requests or cache salts changes nothing for them).",
            ""]


def to_json(res: BenchResults) -> dict:
    best = res.best_limits()
    return {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(res.config).items()},
        "machine": res.machine,
        "limits": asdict(res.limits),
        "best_limits": asdict(best),
        "model": {"body_params": res.cost.body_params, "head_params": res.cost.head_params,
                  "bytes_per_param": res.cost.bytes_per_param, "kv_bytes_per_token": res.cost.kv_bytes_per_token},
        "seconds": res.seconds,
        "roofline": res.roofline,
        "targets": [t.as_dict() for t in targets_of(res)],
        "figures": [f.as_dict() for f in all_figures(res)],
        "workloads": {n: {"description": w.description, "seed": w.seed, "prompt_tokens": w.prompt_tokens,
                          "ideal_computed_tokens": w.ideal_computed_tokens(),
                          "ideal_seconds": ideal_workload_seconds(w, res.cost, best)}
                      for n, w in res.workloads.items()},
        "skipped": res.skipped,
        "serving_memory": res.serving_memory.as_dict() if res.serving_memory else None,
        "runs": [{"engine": r.engine, "workload": r.workload, "wall_s": r.wall_s,
                  "computed_prompt_tokens": r.computed_prompt_tokens, "peak_rss_bytes": r.peak_rss_bytes,
                  "note": r.note, "extra": r.extra, "records": [asdict(x) for x in r.records]} for r in res.runs],
    }


def write_json(res: BenchResults, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_json(res), indent=1) + "\n")


def write_plots(res: BenchResults, folder: Path) -> list[Path]:
    """One grouped bar chart per figure: wall time, TTFT p50, prompt tokens computed / ideal."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    figs = all_figures(res)
    workloads = list(res.workloads)
    engines = sorted({f.engine for f in figs}, key=_engine_key)
    charts = [("wall_time.png", "wall time (s, log scale)", lambda f: f.wall_s, True),
              ("ttft_p50.png", "TTFT p50 (s, log scale)", lambda f: f.ttft_p50_s, True),
              ("computed_tokens.png", "prompt tokens computed / ideal", lambda f: f.computed_prompt_tokens
               / f.ideal_computed_tokens, False)]
    written = []
    width = 0.8 / max(len(engines), 1)
    for fname, label, value, log in charts:
        fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(workloads)), 4.5))
        for i, engine in enumerate(engines):
            xs, ys = [], []
            for j, w in enumerate(workloads):
                f = next((f for f in figs if f.engine == engine and f.workload == w), None)
                if f is not None:
                    xs.append(j + (i - (len(engines) - 1) / 2) * width)
                    ys.append(value(f))
            ax.bar(xs, ys, width, label=engine)
        ax.set_xticks(range(len(workloads)), workloads, rotation=25, ha="right", fontsize=8)
        ax.set_ylabel(label)
        if log:
            ax.set_yscale("log")
        ax.set_title(f"{res.config.model}, {res.config.dtype}, {res.machine['threads']} threads")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(folder / fname, dpi=110)
        plt.close(fig)
        written.append(folder / fname)
    return written
