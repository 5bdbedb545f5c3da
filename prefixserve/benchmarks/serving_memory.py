"""Peak resident memory of a real `prefixserve serve` process against weights + KV pool + 1 GiB.

The bench's in-process figures hold two engines at once (caching on and off, each with its own
weights and KV pool), so they are not what one server needs. Here the server runs as a user starts
it, on the bench's checkpoint, dtype, threads and KV pool, serves one workload over HTTP, and its
own high-water mark (VmHWM: from start, loading included, to after the workload) is read from /proc.
The render process the server spawns for chat templates is a separate process and not counted.
"""
from __future__ import annotations

import json
import os
import urllib.error
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from prometheus_client.parser import text_string_to_metric_families

from prefixserve.benchmarks.memory import process_peak_rss_bytes
from prefixserve.benchmarks.serving_process import ServerProcess, ServerProcessError, http_open
from prefixserve.benchmarks.targets import Target
from prefixserve.benchmarks.workloads import BenchRequest, Workload

HEADROOM_BYTES = 1 << 30
TARGET_NAME = "serving process: peak RSS vs weights + KV pool + 1 GiB"
_MODEL_NAME = "bench"
_GAUGES = ("prefixserve:weights_bytes", "prefixserve:kv_cache_bytes")


class ServingMemoryUnavailable(RuntimeError):
    """Another process's peak resident memory cannot be read here (no /proc/<pid>/status VmHWM)."""


@dataclass(frozen=True)
class ServingMemory:
    peak_rss_bytes: int   # the server's VmHWM after the workload
    weights_bytes: int    # from its /metrics
    kv_cache_bytes: int   # from its /metrics: the KV pool as allocated
    workload: str
    requests: int         # requests it served, every one successfully

    def __post_init__(self) -> None:
        for name in ("peak_rss_bytes", "weights_bytes", "kv_cache_bytes", "requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.workload:
            raise ValueError("workload must be named")

    @property
    def budget_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes + HEADROOM_BYTES

    @property
    def ratio(self) -> float:
        """Peak over budget: at most 1 meets the target."""
        return self.peak_rss_bytes / self.budget_bytes

    def as_dict(self) -> dict:
        return {**asdict(self), "budget_bytes": self.budget_bytes, "ratio": self.ratio}


def memory_target(memory: Optional[ServingMemory]) -> Target:
    if memory is None:
        return Target(TARGET_NAME, "<= 1x", None, None, "no `prefixserve serve` process was measured in this run")
    mib = 1 << 20
    return Target(TARGET_NAME, "<= 1x", memory.ratio, memory.ratio <= 1.0,
                  f"VmHWM of a `prefixserve serve` process that served {memory.workload} "
                  f"({memory.peak_rss_bytes / mib:.0f} MiB) / (weights {memory.weights_bytes / mib:.0f} MiB "
                  f"+ KV pool {memory.kv_cache_bytes / mib:.0f} MiB + 1 GiB)")


def measure_serving_memory(model: str | Path, workload: Workload, *, dtype: str, threads: int,
                           kv_cache_memory: int, startup_timeout_s: float = 300.0,
                           request_timeout_s: float = 1800.0) -> ServingMemory:
    """Starts `prefixserve serve` on `model`, sends `workload` (each round's requests at once, greedy,
    every output its max_tokens), reads the server's peak RSS and its weights and KV pool bytes, and
    stops it, also on error."""
    if threads < 1 or kv_cache_memory < 1:
        raise ValueError(f"threads and kv_cache_memory must be >= 1, got {threads} and {kv_cache_memory}")
    if process_peak_rss_bytes(os.getpid()) is None:
        raise ServingMemoryUnavailable("peak RSS of the server process is unavailable: /proc/<pid>/status "
                                       "has no VmHWM here (Linux only)")
    args = ["--model", str(model), "--dtype", dtype, "--threads", str(threads), "--kv-cache-memory",
            str(kv_cache_memory), "--served-model-name", _MODEL_NAME, "--log-level", "warning"]
    with ServerProcess(args, startup_timeout_s=startup_timeout_s) as server:
        try:
            for rnd in workload.rounds:
                with ThreadPoolExecutor(len(rnd)) as pool:
                    list(pool.map(lambda r: _complete(server.base_url, r, request_timeout_s), rnd))
            gauges = _gauges(server.base_url)
            peak = process_peak_rss_bytes(server.pid)
        except ServerProcessError:
            raise
        except Exception as exc:
            raise server.error(f"measuring the server's memory failed: {exc!r}") from exc
        if peak is None:
            raise server.error(f"the server (pid {server.pid}) ended before its peak RSS could be read")
    return ServingMemory(peak_rss_bytes=peak, weights_bytes=int(gauges["prefixserve:weights_bytes"]),
                         kv_cache_bytes=int(gauges["prefixserve:kv_cache_bytes"]), workload=workload.name,
                         requests=len(workload.requests))


def _complete(base_url: str, req: BenchRequest, timeout: float) -> None:
    body = {"model": _MODEL_NAME, "prompt": list(req.prompt_token_ids), "max_tokens": req.max_tokens,
            "temperature": 0.0, "ignore_eos": True}
    if req.cache_salt is not None:
        body["cache_salt"] = req.cache_salt
    try:
        with http_open(base_url + "/v1/completions", json.dumps(body).encode(), timeout) as resp:
            answer = json.load(resp)
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"request {req.request_id}: HTTP {exc.code}: {exc.read()[:300]!r}") from None
    got = answer["usage"]["completion_tokens"]
    if got != req.max_tokens:
        raise RuntimeError(f"request {req.request_id}: {got} tokens generated, {req.max_tokens} asked "
                           f"(finish reason {answer['choices'][0].get('finish_reason')!r})")


def _gauges(base_url: str) -> dict[str, float]:
    with http_open(base_url + "/metrics") as resp:
        text = resp.read().decode()
    found = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
             if s.name in _GAUGES}
    missing = [name for name in _GAUGES if name not in found]
    if missing:
        raise RuntimeError(f"/metrics has no {', '.join(missing)}")
    return found
