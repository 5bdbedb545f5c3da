"""Runs every selected workload on every engine in one process, on one checkpoint, with progress bars.

Engines are loaded one family at a time (prefixserve, then transformers, then
llama.cpp) so only one copy of the weights is resident while another is timed.
After prefixserve's engines, a `prefixserve serve` subprocess is measured for the
peak memory of one server (serving_memory.py).
"""
from __future__ import annotations

import json
import os
import platform
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from prefixserve.benchmarks.checkpoint import DEFAULT_CACHE_DIR, checkpoint_folder
from prefixserve.benchmarks.engines import ENGINE_NAMES, RunResult
from prefixserve.benchmarks.limits import MachineLimits, ModelCost, measure_limits
from prefixserve.benchmarks.serving_memory import ServingMemory, ServingMemoryUnavailable, measure_serving_memory
from prefixserve.benchmarks.workloads import WORKLOAD_NAMES, Workload, build_workload, without_salts
from prefixserve.model import ModelConfig
from prefixserve.platforms.cpu.native import packed_gemm
from prefixserve.platforms.cpu.native.isa import cpu_fields, cpu_probe


# KV pool of the prefixserve engines: room for every full workload's largest round without caching.
_KV_POOL, _KV_POOL_QUICK = 2 << 30, 1 << 30
# The workloads whose wall time is judged against the machine's limits (long-doc-qa's fraction of its ideal
# time): the limits are read around each of their runs.
JUDGED_AGAINST_LIMITS_AROUND = ("long-doc-qa",)


@dataclass(frozen=True)
class BenchConfig:
    model: str = "random:qwen3-0.6b"
    dtype: str = "float32"
    workloads: tuple[str, ...] = WORKLOAD_NAMES
    engines: tuple[str, ...] = ENGINE_NAMES
    quick: bool = False
    threads: int = 2
    seed: int = 0
    cache_dir: Path = DEFAULT_CACHE_DIR
    # llama.cpp KV in float32 like the others; False falls back to its default float16
    llama_kv_f32: bool = True

    def __post_init__(self) -> None:
        for name in self.workloads:
            if name not in WORKLOAD_NAMES:
                raise ValueError(f"workloads: unknown workload {name!r}; choose from {', '.join(WORKLOAD_NAMES)}")
        for name in self.engines:
            if name not in ENGINE_NAMES:
                raise ValueError(f"engines: unknown engine {name!r}; choose from {', '.join(ENGINE_NAMES)}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")


@dataclass
class BenchResults:
    config: BenchConfig
    machine: dict
    limits: MachineLimits
    cost: ModelCost
    workloads: dict[str, Workload]
    runs: list[RunResult] = field(default_factory=list)
    roofline: dict = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)   # engine -> why it did not run
    # one `prefixserve serve` process on long-doc-qa (None: prefixserve not benchmarked, or not measurable)
    serving_memory: Optional[ServingMemory] = None
    seconds: float = 0.0

    def limits_around(self, workload: str) -> MachineLimits:
        """The limits prefixserve's kept run of `workload` is judged against: the better of the readings
        taken just before and just after that run (`_read_limits_around`), or the run's best limits where
        none were taken. The machine's bandwidth moved 39-77 GB/s within one run on a 2-core EPYC; a
        reading from minutes earlier says what the machine could do then, not while the workload ran."""
        run = next((r for r in self.runs if r.engine == "prefixserve" and r.workload == workload), None)
        around = run.extra.get("limits_around") if run is not None else None
        if around is None:
            return self.best_limits()
        return replace(self.limits, matmul_flops=around["matmul_flops"], bandwidth_bytes=around["bandwidth_bytes"])

    def best_limits(self) -> MachineLimits:
        """The limits the workloads' ideal times are set against: the highest matmul rate and bandwidth of
        every reading the run took: at its start, around the single-request rounds (the prefill's peaks,
        the batch-1 decode's median paired bandwidth), the batched decode's median paired readings, and
        those around each of prefixserve's workload runs. On a shared machine one reading can come out low
        (81 against 155 GFLOP/s within one run on a 2-core EPYC); the best of all only makes a ratio
        stricter. The targets judged against the limits use readings taken next to what they time instead."""
        flops, bandwidth = [self.limits.matmul_flops], [self.limits.bandwidth_bytes]
        if "prefill" in self.roofline:
            flops.append(self.roofline["prefill"]["matmul_flops"])
        if "decode_b1" in self.roofline:
            bandwidth.append(self.roofline["decode_b1"]["bandwidth_bytes"])
        batched = self.roofline.get("batched_decode", {})
        for readings in [batched] + [run.extra.get("limits_around") or {} for run in self.runs]:
            flops.append(readings.get("matmul_flops", 0.0))
            bandwidth.append(readings.get("bandwidth_bytes", 0.0))
        return replace(self.limits, matmul_flops=max(flops), bandwidth_bytes=max(bandwidth))


def machine_info(threads: int) -> dict:
    """The CPU as a report names it: /proc/cpuinfo's model name, with family and model where the name
    alone does not tell a generation (a VM may say only "AMD EPYC"), and the bfloat16 features torch
    (and so oneDNN and the kernels) can use, which decide what the bfloat16 figures mean."""
    fields = cpu_fields()
    cpu = fields.get("model name") or platform.processor() or "unknown"
    if "cpu family" in fields and "model" in fields:
        cpu += f" (family {fields['cpu family']}, model {fields['model']})"
    amx, tiles = cpu_probe("_is_amx_tile_supported"), "no AMX"
    if amx:
        gemm = packed_gemm.default_kernel()
        tiles = "AMX" + (", bfloat16 projections on its tiles" if gemm is not None and gemm.tiles
                         else ", bfloat16 projections not on its tiles")
    features = ", ".join([("" if cpu_probe("_is_avx512_bf16_supported") else "no ") + "avx512_bf16", tiles])
    return {"cpu": cpu, "cpu_features": features, "amx": amx, "logical_cpus": os.cpu_count(), "threads": threads,
            "torch": torch.__version__, "python": platform.python_version()}


class _Progress:
    """One bar per (engine, workload) run, advanced per finished request."""

    def __init__(self, console: Optional[Console]) -> None:
        self.bar = Progress(TextColumn("{task.description:<42}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=console, transient=False) if console else None

    def __enter__(self) -> "_Progress":
        if self.bar:
            self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar:
            self.bar.stop()

    def run(self, engine, workload: Workload, label: Optional[str] = None, **kwargs) -> RunResult:
        name = label or engine.name
        advance: Callable[[], None] = lambda: None
        if self.bar:
            task = self.bar.add_task(f"{name} · {workload.name}", total=len(workload.requests))
            advance = lambda: self.bar.advance(task)
        result = engine.run(workload, advance, **kwargs)
        result.engine = name
        if self.bar and not self.bar.console.is_terminal:
            # Without a terminal the bars only show at the end: log each finished run as it happens.
            self.bar.console.print(f"{name} · {workload.name}: {result.wall_s:.2f} s")
        return result

    def note(self, text: str) -> None:
        if self.bar:
            self.bar.console.print(text)


def run_benchmark(config: BenchConfig, console: Optional[Console] = None) -> BenchResults:
    torch.set_num_threads(config.threads)
    started = time.monotonic()
    folder = checkpoint_folder(config.model, config.dtype, config.seed, config.cache_dir)
    model_config = ModelConfig.from_hf_config(json.loads((folder / "config.json").read_text()))
    torch_dtype = getattr(torch, config.dtype)
    cost = ModelCost(model_config, torch.tensor([], dtype=torch_dtype).element_size())
    workloads = {name: build_workload(name, config.quick) for name in config.workloads}
    with (console.status("measuring the machine's limits") if console else nullcontext()):
        limits = measure_limits(torch_dtype, quick=config.quick)
    results = BenchResults(config, machine_info(config.threads), limits, cost, workloads)
    with _Progress(console) as progress:
        if "prefixserve" in config.engines:
            _run_prefixserve(config, folder, workloads, progress, results)
            _measure_serving_memory(config, folder, progress, results)
        if {"hf-padded", "hf-reuse"} & set(config.engines):
            _run_hf(config, folder, workloads, progress, results)
        for quant, name in ((None, "llama.cpp"), ("Q8_0", "llama.cpp-q8_0")):
            if name in config.engines:
                _run_llama_cpp(config, folder, workloads, progress, results, quant, name)
    results.seconds = time.monotonic() - started
    return results


def _run_prefixserve(config: BenchConfig, folder: Path, workloads: dict[str, Workload], progress: _Progress,
                     results: BenchResults) -> None:
    from prefixserve.benchmarks.engines.prefixserve_engine import PrefixServeEngine
    from prefixserve.benchmarks.roofline import measure_roofline

    plain = [w for w in workloads.values() if w.kv_blocks is None]
    pool = _kv_pool(config)
    # Caching on and off are both resident so their runs of a workload alternate: the ratio of the two
    # then does not depend on what the shared machine did in the minutes between them.
    on = PrefixServeEngine("prefixserve", folder, config.dtype, kv_cache_memory=pool)
    off = PrefixServeEngine("prefixserve-nocache", folder, config.dtype, prefix_caching=False, kv_cache_memory=pool)
    read = partial(measure_limits, getattr(torch, config.dtype), quick=config.quick)
    try:
        for w in plain:
            cached, uncached = _alternating_best_of(progress, on, off, w, _repeats(config, w),
                                                    read if w.name in JUDGED_AGAINST_LIMITS_AROUND else None)
            results.runs.append(cached)
            on.warm = True
            results.runs.append(progress.run(on, w, label="prefixserve-warm"))
            on.warm = False
            results.runs.append(uncached)
            if w.name == "tenants":
                unsalted = progress.run(on, without_salts(w))
                unsalted.engine, unsalted.workload = "prefixserve-unsalted", w.name
                results.runs.append(unsalted)
        off.close()
        progress.note("measuring prefill, decode and warm TTFT against the machine's limits")
        results.roofline = measure_roofline(on.engine, results.cost, results.limits, config.quick)
    finally:
        on.close()
        off.close()
    by_pool: dict[int, list[Workload]] = {}
    for w in workloads.values():
        if w.kv_blocks is not None:
            by_pool.setdefault(w.kv_blocks, []).append(w)
    for blocks, group in by_pool.items():
        limited = PrefixServeEngine("prefixserve", folder, config.dtype, num_kv_blocks=blocks)
        try:
            for w in group:
                results.runs.append(progress.run(limited, w))
        finally:
            limited.close()


def _kv_pool(config: BenchConfig) -> int:
    return _KV_POOL_QUICK if config.quick else _KV_POOL


def _measure_serving_memory(config: BenchConfig, folder: Path, progress: _Progress, results: BenchResults) -> None:
    """After the in-process engines are closed, so the machine has the memory a lone server would."""
    workload = build_workload("long-doc-qa", config.quick)
    progress.note(f"measuring a `prefixserve serve` process's peak memory on {workload.name}")
    try:
        results.serving_memory = measure_serving_memory(folder, workload, dtype=config.dtype, threads=config.threads,
                                                        kv_cache_memory=_kv_pool(config))
    except ServingMemoryUnavailable as exc:
        results.skipped["prefixserve serve (memory)"] = str(exc)
        progress.note(f"[yellow]serving process memory not measured: {exc}")


def _repeats(config: BenchConfig, w: Workload) -> int:
    # no-sharing judges a 2% difference (caching on vs off): three back-to-back pairs, judged by their median.
    # long-doc-qa's wall time is set against an ideal from the limits read around it: one run of a few
    # seconds drifts 5-10% with the shared machine (2.49-2.84 s back to back), so the fastest of three is kept.
    return 3 if w.name in ("no-sharing", "long-doc-qa") and not config.quick else 1


def _alternating_best_of(progress: _Progress, first, second, w: Workload, repeats: int,
                         read_limits: Optional[Callable[[], MachineLimits]] = None) -> tuple[RunResult, RunResult]:
    """Runs `first`, `second`, `first`, ... and keeps each engine's fastest run. The first's kept run
    also records every paired wall-time ratio (first / second, back to back) as `paired_ratios`. With
    `read_limits`, each of the first's runs records the limits read around it."""
    def run_first() -> RunResult:
        return _read_limits_around(lambda: progress.run(first, w), read_limits) if read_limits else \
            progress.run(first, w)

    runs = [(run_first(), progress.run(second, w)) for _ in range(repeats)]
    best_first = min((a for a, _ in runs), key=lambda r: r.wall_s)
    best_second = min((b for _, b in runs), key=lambda r: r.wall_s)
    if repeats > 1:
        best_first.extra["paired_ratios"] = [a.wall_s / b.wall_s for a, b in runs]
    return best_first, best_second


def _read_limits_around(run: Callable[[], RunResult], read: Callable[[], MachineLimits]) -> RunResult:
    """`run()`, with the better matmul rate and the better bandwidth of a reading just before it and one
    just after it as `extra["limits_around"]`."""
    before = read()
    result = run()
    after = read()
    result.extra["limits_around"] = {"matmul_flops": max(before.matmul_flops, after.matmul_flops),
                                     "bandwidth_bytes": max(before.bandwidth_bytes, after.bandwidth_bytes)}
    return result


def _run_hf(config: BenchConfig, folder: Path, workloads: dict[str, Workload], progress: _Progress,
            results: BenchResults) -> None:
    from prefixserve.benchmarks.engines.hf_engines import HFPaddedEngine, HFReuseEngine
    padded = HFPaddedEngine(folder, config.dtype)
    reuse = HFReuseEngine.sharing(padded)
    try:
        for w in workloads.values():
            for engine in (padded, reuse):
                if engine.name in config.engines and engine.name not in w.skip_engines:
                    results.runs.append(progress.run(engine, w))
    finally:
        padded.close()


def _run_llama_cpp(config: BenchConfig, folder: Path, workloads: dict[str, Workload], progress: _Progress,
                   results: BenchResults, quant: Optional[str], name: str) -> None:
    """llama.cpp on the checkpoint's weights exported to GGUF in the benchmark's dtype, or quantized (`quant`,
    reported as `name`)."""
    from prefixserve.benchmarks.engines.base import tokenizer_vocab_size
    from prefixserve.benchmarks.engines.llama_cpp_engine import LlamaCppEngine, llama_cpp_available
    from prefixserve.benchmarks.gguf_export import gguf_path_for
    why = llama_cpp_available()
    if why is not None:
        results.skipped[name] = why
        progress.note(f"[yellow]{name} skipped: {why}")
        return
    gguf = gguf_path_for(folder, quant)
    longest = max(len(r.prompt_token_ids) + r.max_tokens for w in workloads.values() for r in w.requests)
    engine = LlamaCppEngine(gguf, threads=config.threads, n_ctx=max(512, longest + 64), kv_f32=config.llama_kv_f32,
                            vocab_limit=tokenizer_vocab_size(folder))
    try:
        for w in workloads.values():
            if engine.name in w.skip_engines:
                continue
            # Under a limited pool, the RAM prompt cache gets the bytes prefixserve's KV pool has.
            budget = {}
            if w.kv_blocks is not None:
                budget["cache_bytes"] = w.kv_blocks * 16 * results.cost.kv_bytes_per_token
            results.runs.append(progress.run(engine, w, label=name, **budget))
    finally:
        engine.close()
