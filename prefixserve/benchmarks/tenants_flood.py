"""The `tenants-flood` workload: a quiet tenant under another tenant's flood, on a real server.

`prefixserve bench --workload tenants-flood` (or `python -m prefixserve.benchmarks.tenants_flood`)
starts `prefixserve serve` with a keys file of two tenants and sends, with Poisson arrivals:
the quiet tenant at a steady rate, each request its own long system prompt plus a short
question; the flooding tenant at ten times that rate, each request a distinct long prompt. It
runs the quiet tenant solo, then under the flood with fairness off (one queue, FCFS, one global
LRU), with fair scheduling alone, with cache shares alone and with both; then a single tenant
at saturation with the features off and on. Reported: the quiet tenant's TTFT p50/p99, prefix
hit rate and 429s; the flooding tenant's TTFT p50, tokens served per second and 429s; the step
time under the flood (the quiet tenant's inter-token gap, p50); and the single tenant's
throughput, server CPU time per request and hit rate. Each configuration runs `repeats` times,
interleaved, and every figure is the median of its runs: on a shared machine one run's wall
clock says more about the neighbours than about the server. docs/benchmarks.md keeps a run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx

from prefixserve.benchmarks.serving_process import ServerProcess

WORKLOAD = "tenants-flood"
QUIET, FLOOD, ADMIN = "bench-key-quiet-0001", "bench-key-flood-0002", "bench-key-admin-0003"
KEYS = {QUIET: "quiet", FLOOD: "flood", ADMIN: {"tenant": "ops", "admin": True}}
FEATURES = {"off": ("--no-fair-scheduling", "--no-tenant-cache-shares"),
            "fair": ("--fair-scheduling", "--no-tenant-cache-shares"),
            "shares": ("--no-fair-scheduling", "--tenant-cache-shares"),
            "on": ("--fair-scheduling", "--tenant-cache-shares")}


@dataclass(frozen=True)
class FloodConfig:
    model: str = "random:qwen3-tiny"
    threads: int = 2
    num_kv_blocks: int = 256
    max_waiting: int = 24
    quiet_rate: float = 4.0          # requests/s; the flood sends flood_ratio times as many
    flood_ratio: float = 10.0
    duration_s: float = 8.0
    quiet_system_tokens: int = 900
    flood_prompt_tokens: int = 650
    question_tokens: int = 16
    max_tokens: int = 8
    single_requests: int = 150
    single_concurrency: int = 8
    repeats: int = 2
    seed: int = 0
    # the server's token budget per step (None: its default); with a model whose steps outlast the
    # HTTP front's fixed cost, the TTFT targets measure the scheduler rather than the front
    max_num_batched_tokens: Optional[int] = None
    # the flood table only: the single-tenant and engine-step tables do not depend on the model
    # and take minutes a configuration on a larger one
    flood_only: bool = False


@dataclass
class Record:
    tenant: str
    status: int
    ttft_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


async def _send(client: httpx.AsyncClient, key: str, tenant: str, prompt: list[int], max_tokens: int,
                arrival: float) -> Record:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    times: list[float] = []
    record = Record(tenant, 0)
    async with client.stream("POST", "/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as resp:
        record.status = resp.status_code
        if resp.status_code != 200:
            await resp.aread()
            return record
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            event = json.loads(line[5:])
            if event.get("choices"):
                times.append(time.monotonic())
            usage = event.get("usage")
            if usage:
                record.prompt_tokens = usage["prompt_tokens"]
                record.completion_tokens = usage["completion_tokens"]
                record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    record.ttft_s = (times[0] if times else time.monotonic()) - arrival
    record.gaps_s = [b - a for a, b in zip(times, times[1:])]
    return record


async def _at(client: httpx.AsyncClient, at: float, key: str, tenant: str, prompt: list[int],
              max_tokens: int) -> Record:
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    # latency counts from the scheduled arrival, so a late client loop cannot hide queueing
    return await _send(client, key, tenant, prompt, max_tokens, at)


def _arrivals(rng: random.Random, rate: float, duration_s: float) -> list[float]:
    times, t = [], rng.expovariate(rate)
    while t < duration_s:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 4000) for _ in range(n)]


async def _flood_run(url: str, cfg: FloodConfig, with_flood: bool) -> tuple[list[Record], float]:
    rng = random.Random(cfg.seed)
    system = _tokens(rng, cfg.quiet_system_tokens)
    plan = [(t, QUIET, "quiet", system + _tokens(rng, cfg.question_tokens))
            for t in _arrivals(rng, cfg.quiet_rate, cfg.duration_s)]
    if with_flood:
        plan += [(t, FLOOD, "flood", _tokens(rng, cfg.flood_prompt_tokens))
                 for t in _arrivals(rng, cfg.quiet_rate * cfg.flood_ratio, cfg.duration_s)]
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        # the quiet tenant's system prompt is computed once before the clock starts, as a
        # tenant's steady state would have it
        await _send(client, QUIET, "quiet", system + _tokens(rng, cfg.question_tokens), 1, time.monotonic())
        start = time.monotonic()
        records = await asyncio.gather(*(_at(client, start + t, key, tenant, prompt, cfg.max_tokens)
                                         for t, key, tenant, prompt in plan))
        return list(records), time.monotonic() - start


async def _single_run(url: str, cfg: FloodConfig) -> tuple[list[Record], float]:
    """One tenant at saturation: half its requests share a system prompt, half are distinct."""
    rng = random.Random(cfg.seed + 1)
    system = _tokens(rng, cfg.quiet_system_tokens)
    prompts = [system + _tokens(rng, cfg.question_tokens) if i % 2 == 0 else _tokens(rng, cfg.flood_prompt_tokens)
               for i in range(cfg.single_requests)]
    sem = asyncio.Semaphore(cfg.single_concurrency)

    async def one(prompt: list[int]) -> Record:
        async with sem:
            return await _send(client, QUIET, "quiet", prompt, cfg.max_tokens, time.monotonic())

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.monotonic()
        records = await asyncio.gather(*(one(p) for p in prompts))
        return list(records), time.monotonic() - start


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used (Linux /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _median_of(runs: list[dict]) -> dict:
    """Field by field, the median of the runs' numbers (nested dicts likewise)."""
    out: dict = {}
    for key, value in runs[0].items():
        if isinstance(value, dict):
            out[key] = _median_of([r[key] for r in runs])
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in runs)
        else:
            out[key] = value
    return out


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _summary(label: str, records: list[Record], wall_s: float) -> dict:
    out: dict = {"run": label, "wall_s": wall_s}
    for tenant in ("quiet", "flood"):
        mine = [r for r in records if r.tenant == tenant]
        done = [r for r in mine if r.status == 200]
        prompt = sum(r.prompt_tokens for r in done)
        out[tenant] = {
            "sent": len(mine), "done": len(done), "refused": sum(r.status == 429 for r in mine),
            "other_errors": sum(r.status not in (200, 429) for r in mine),
            "ttft_p50_ms": _pct([r.ttft_s for r in done], 0.5) * 1000,
            "ttft_p99_ms": _pct([r.ttft_s for r in done], 0.99) * 1000,
            "hit_rate": sum(r.cached_tokens for r in done) / prompt if prompt else 0.0,
            "served_tok_per_s": sum(r.prompt_tokens + r.completion_tokens for r in done) / wall_s,
            "gap_p50_ms": _pct([g for r in done for g in r.gaps_s], 0.5) * 1000,
        }
    return out


def _serve_args(cfg: FloodConfig, keys_path: Path, features: str) -> list[str]:
    return ["--model", cfg.model, "--api-keys", str(keys_path), "--num-kv-blocks", str(cfg.num_kv_blocks),
            "--max-waiting", str(cfg.max_waiting), "--threads", str(cfg.threads), "--seed", str(cfg.seed),
            "--log-level", "warning", *FEATURES[features],
            *(("--max-num-batched-tokens", str(cfg.max_num_batched_tokens)) if cfg.max_num_batched_tokens else ())]


def engine_steps_run(cfg: FloodConfig, features: str, steps: int = 300, quiet_every: int = 10,
                     quiet: str = "sends") -> dict:
    """The same two tenants on an engine driven step by step, no server: what the scheduler and
    the cache do, free of the HTTP front and of the neighbours' load. Quiet arrives every
    `quiet_every` steps, flood every step (ten times the rate, its queue unbounded); counted in
    steps: from a quiet request's arrival to the step that gives its first token. `quiet`:
    "sends" (as described), "idle" (its system prompt computed once, then nothing: what its
    cache floor alone costs the flood) or "absent" (the flood alone on the whole pool)."""
    from prefixserve import EngineConfig, LLMEngine, SamplingParams

    fair, shares = FEATURES[features][0] == "--fair-scheduling", FEATURES[features][1] == "--tenant-cache-shares"
    engine = LLMEngine(EngineConfig(model=cfg.model, seed=cfg.seed, num_kv_blocks=cfg.num_kv_blocks,
                                    tenant_weights={t if isinstance(t, str) else t["tenant"]: 1.0
                                                    for t in KEYS.values()},
                                    fair_scheduling=fair, tenant_cache_shares=shares))
    rng = random.Random(cfg.seed)
    system = _tokens(rng, cfg.quiet_system_tokens)
    params = SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0, ignore_eos=True)
    arrived: dict[str, int] = {}
    waited: list[int] = []
    waited_ids: set[str] = set()
    hits: list[float] = []
    flood_tokens = 0
    step = 0
    warm = system + _tokens(rng, cfg.question_tokens)
    if quiet != "absent":
        engine.add_request("warm", {"prompt_token_ids": warm}, params, tenant="quiet")
    while engine.has_unfinished_requests():
        engine.step()
    while step < steps or engine.has_unfinished_requests():
        if step < steps:
            engine.add_request(f"f{step}", {"prompt_token_ids": _tokens(rng, cfg.flood_prompt_tokens)}, params,
                               tenant="flood")
            if quiet == "sends" and step % quiet_every == 0:
                engine.add_request(f"q{step}", {"prompt_token_ids": system + _tokens(rng, cfg.question_tokens)},
                                   params, tenant="quiet")
                arrived[f"q{step}"] = step
        for out in engine.step():
            if out.request_id in arrived and out.outputs[0].token_ids and out.request_id not in waited_ids:
                waited_ids.add(out.request_id)
                waited.append(step - arrived[out.request_id] + 1)
                hits.append(out.num_cached_tokens / len(out.prompt_token_ids))
            if out.finished and out.request_id.startswith("f"):
                flood_tokens += len(out.prompt_token_ids) + len(out.outputs[0].token_ids)
        step += 1
    label = features if quiet == "sends" else f"{features}, quiet {quiet}"
    return {"run": label, "quiet_steps_p50": statistics.median(waited) if waited else None,
            "quiet_steps_max": max(waited) if waited else None,
            "quiet_hit_rate": statistics.fmean(hits) if hits else None, "steps": step, "flood_tokens": flood_tokens}


FLOOD_RUNS = (("quiet solo", "on", False), ("flood, fairness off", "off", True),
              ("flood, fair scheduling only", "fair", True), ("flood, cache shares only", "shares", True),
              ("flood, fair + shares", "on", True))
SINGLE_RUNS = (("single tenant, features off", "off"), ("single tenant, features on", "on"))


def run_tenants_flood(cfg: FloodConfig, log=print) -> tuple[str, dict]:
    """Runs every configuration `repeats` times; returns (markdown, data)."""
    flood_runs: dict[str, list[dict]] = {label: [] for label, _, _ in FLOOD_RUNS}
    single_runs: dict[str, list[dict]] = {label: [] for label, _ in SINGLE_RUNS}
    with tempfile.TemporaryDirectory() as tmp:
        keys_path = Path(tmp) / "keys.json"
        keys_path.write_text(json.dumps(KEYS))
        keys_path.chmod(0o600)
        for repeat in range(cfg.repeats):
            for label, features, with_flood in FLOOD_RUNS:
                log(f"{WORKLOAD}: {label} ({repeat + 1}/{cfg.repeats})")
                with ServerProcess(_serve_args(cfg, keys_path, features)) as server:
                    records, wall = asyncio.run(_flood_run(server.base_url, cfg, with_flood))
                flood_runs[label].append(_summary(label, records, wall))
            for label, features in () if cfg.flood_only else SINGLE_RUNS:
                log(f"{WORKLOAD}: {label} ({repeat + 1}/{cfg.repeats})")
                with ServerProcess(_serve_args(cfg, keys_path, features)) as server:
                    cpu = _cpu_s(server.pid)
                    records, wall = asyncio.run(_single_run(server.base_url, cfg))
                    cpu = _cpu_s(server.pid) - cpu
                s = _summary(label, records, wall)["quiet"]
                single_runs[label].append({"run": label, "wall_s": wall, "req_per_s": s["done"] / wall,
                                           "tok_per_s": s["served_tok_per_s"], "hit_rate": s["hit_rate"],
                                           "cpu_ms_per_req": cpu * 1000 / max(1, s["done"]),
                                           "errors": s["refused"] + s["other_errors"]})
    rows = [_median_of(runs) for runs in flood_runs.values()]
    singles = [_median_of(runs) for runs in single_runs.values() if runs]
    steps = []
    for features, quiet in () if cfg.flood_only else (("off", "sends"), ("fair", "sends"), ("shares", "sends"),
                                                       ("on", "sends"), ("on", "idle"), ("on", "absent")):
        log(f"{WORKLOAD}: engine steps, {features}, quiet {quiet}")
        steps.append(engine_steps_run(cfg, features, quiet=quiet))
    data = {"workload": WORKLOAD, "cpu": cpu_name(), "config": cfg.__dict__, "flood": rows, "single": singles,
            "engine_steps": steps}
    return to_markdown(data), data


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def to_markdown(data: dict) -> str:
    cfg = data["config"]
    budget = f"step budget {cfg['max_num_batched_tokens']} tokens; " if cfg.get("max_num_batched_tokens") else ""
    lines = [f"`{WORKLOAD}` on {data['cpu']}, {cfg['model']}, --threads {cfg['threads']}, "
             f"{cfg['num_kv_blocks']}-block pool, --max-waiting {cfg['max_waiting']}; quiet: "
             f"{cfg['quiet_rate']:g} req/s, {cfg['quiet_system_tokens']}-token system prompt + "
             f"{cfg['question_tokens']}-token question; flood: {cfg['quiet_rate'] * cfg['flood_ratio']:g} req/s of "
             f"distinct {cfg['flood_prompt_tokens']}-token prompts; {cfg['duration_s']:g} s of arrivals, "
             f"{cfg['max_tokens']} output tokens each; "
             f"{budget}medians of {cfg['repeats']} interleaved runs.", "",
             "| run | quiet TTFT p50 / p99 ms | quiet hit rate | quiet 429s | flood TTFT p50 ms | "
             "flood served tok/s | flood 429s | step p50 ms (quiet inter-token gap) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in data["flood"]:
        q, f = r["quiet"], r["flood"]
        flood = (f"{f['ttft_p50_ms']:.0f} | {f['served_tok_per_s']:.0f} | {f['refused']:g}/{f['sent']:g}"
                 if f["sent"] else "– | – | –")
        lines.append(f"| {r['run']} | {q['ttft_p50_ms']:.0f} / {q['ttft_p99_ms']:.0f} | {q['hit_rate']:.3f} | "
                     f"{q['refused']:g}/{q['sent']:g} | {flood} | {q['gap_p50_ms']:.1f} |")
    lines += ["", *_ttft_targets(data["flood"])]
    if not data["single"] and not data.get("engine_steps"):
        return "\n".join(lines)
    lines += ["", f"Single tenant at saturation ({cfg['single_requests']} requests, {cfg['single_concurrency']} "
                  "at a time, half sharing a system prompt):", "",
              "| run | req/s | tok/s (prompt + output) | server CPU ms per request | hit rate | errors |",
              "|---|---|---|---|---|---|"]
    for s in data["single"]:
        lines.append(f"| {s['run']} | {s['req_per_s']:.2f} | {s['tok_per_s']:.0f} | {s['cpu_ms_per_req']:.1f} | "
                     f"{s['hit_rate']:.3f} | {s['errors']:.0f} |")
    lines += ["", "The same two tenants on the engine driven step by step (no server; flood every step, quiet "
                  "every 10th, flood's queue unbounded): steps from a quiet request's arrival to its first token "
                  "(1: the step right after it arrived).", "",
              "| features | quiet steps to first token p50 / max | quiet hit rate | steps to drain | "
              "flood tokens served |", "|---|---|---|---|---|"]
    for r in data.get("engine_steps", ()):
        waited = (f"{r['quiet_steps_p50']:g} / {r['quiet_steps_max']} | {r['quiet_hit_rate']:.3f}"
                  if r["quiet_steps_p50"] is not None else "– | –")
        lines.append(f"| {r['run']} | {waited} | {r['steps']} | {r['flood_tokens']} |")
    return "\n".join(lines)


def _ttft_targets(rows: list[dict]) -> list[str]:
    """The issue's TTFT targets, read off this run: under the flood with fair scheduling and cache
    shares, the quiet tenant's TTFT p50 at most two step times (its inter-token gap p50) and at
    most a quarter of the flooding tenant's TTFT p50."""
    on = next((r for r in rows if r["run"] == "flood, fair + shares"), None)
    if on is None:
        return []
    q, f = on["quiet"], on["flood"]
    two_steps, quarter = 2 * q["gap_p50_ms"], f["ttft_p50_ms"] / 4

    def verdict(ok: bool) -> str:
        return "met" if ok else "not met"
    return [f"Targets (fair + shares): quiet TTFT p50 {q['ttft_p50_ms']:.1f} ms against two step times "
            f"{two_steps:.1f} ms ({verdict(q['ttft_p50_ms'] <= two_steps)}) and a quarter of the flood's TTFT p50 "
            f"{quarter:.1f} ms ({verdict(q['ttft_p50_ms'] <= quarter)})."]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=FloodConfig.model)
    p.add_argument("--threads", type=int, default=FloodConfig.threads)
    p.add_argument("--duration", type=float, default=FloodConfig.duration_s, help="seconds of arrivals")
    p.add_argument("--quiet-rate", type=float, default=FloodConfig.quiet_rate, help="quiet requests/s")
    p.add_argument("--repeats", type=int, default=FloodConfig.repeats, help="runs of each configuration")
    p.add_argument("--max-waiting", type=int, default=FloodConfig.max_waiting,
                   help="the servers' --max-waiting (each of the three keys' share is a third)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="the servers' step token budget")
    p.add_argument("--flood-only", action="store_true",
                   help="the flood table only (no single-tenant or engine-step table)")
    p.add_argument("--json", type=Path, metavar="OUT")
    p.add_argument("--markdown", type=Path, metavar="OUT")
    args = p.parse_args(argv)
    cfg = FloodConfig(model=args.model, threads=args.threads, duration_s=args.duration, quiet_rate=args.quiet_rate,
                      repeats=args.repeats, max_waiting=args.max_waiting,
                      max_num_batched_tokens=args.max_num_batched_tokens,
                      flood_only=args.flood_only)
    text, data = run_tenants_flood(cfg)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
