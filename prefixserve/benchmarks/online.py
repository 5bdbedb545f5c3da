"""Online mode: a workload sent to a running OpenAI-compatible server with Poisson arrivals.

Each request is a streamed /v1/completions call with the prompt as token ids;
TTFT is the time to the first streamed chunk that carries text, end to end the
time to the stream's end. A round starts when every request of the previous
round has finished (multi-turn histories depend on them); inside a round,
requests arrive with exponential gaps of mean 1 / rate.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Optional

import httpx

from prefixserve.benchmarks.engines import RequestRecord, RunResult
from prefixserve.benchmarks.engines.base import OnRequestDone
from prefixserve.benchmarks.workloads import BenchRequest, Workload


async def _model_name(client: httpx.AsyncClient) -> str:
    resp = await client.get("/v1/models")
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise ValueError("the server lists no model at /v1/models")
    return data[0]["id"]


async def _one(client: httpx.AsyncClient, model: str, req: BenchRequest, arrival: float) -> RequestRecord:
    body = {"model": model, "prompt": list(req.prompt_token_ids), "max_tokens": req.max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    if req.cache_salt is not None:
        body["cache_salt"] = req.cache_salt
    first: Optional[float] = None
    cached = 0
    chunks = 0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"request {req.request_id}: HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            event = json.loads(payload)
            if event.get("choices"):
                chunks += 1
                if first is None:
                    first = time.monotonic()
            usage = event.get("usage")
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                chunks = usage.get("completion_tokens", chunks)
    end = time.monotonic()
    # Token ids are not streamed by the OpenAI protocol; the record keeps only their count.
    return RequestRecord(req.request_id, len(req.prompt_token_ids), cached, [-1] * chunks,
                         (first or end) - arrival, end - arrival)


async def _run(url: str, workload: Workload, rate: float, seed: int, on_done: OnRequestDone,
               timeout: float) -> RunResult:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), timeout=timeout) as client:
        model = await _model_name(client)
        records: list[RequestRecord] = []
        start = time.monotonic()
        for rnd in workload.rounds:
            t = time.monotonic()
            tasks = []
            for req in rnd:
                t += rng.expovariate(rate)
                tasks.append(asyncio.create_task(_delayed(client, model, req, t, on_done)))
            records.extend(await asyncio.gather(*tasks))
        wall = time.monotonic() - start
    computed = sum(r.prompt_tokens - r.cached_tokens for r in records)
    return RunResult(f"online {url}", workload.name, records, wall, computed, 0,
                     note=f"Poisson arrivals at {rate:g} req/s; computed = prompt - cached_tokens reported by server")


async def _delayed(client: httpx.AsyncClient, model: str, req: BenchRequest, at: float,
                   on_done: OnRequestDone) -> RequestRecord:
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    # Latencies count from the scheduled arrival, so a slow client loop cannot hide queueing.
    record = await _one(client, model, req, at)
    on_done()
    return record


def run_online(url: str, workload: Workload, rate: float, *, seed: int = 0, on_done: OnRequestDone = lambda: None,
               timeout: float = 600.0) -> RunResult:
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"online URL must start with http:// or https://, got {url!r}")
    return asyncio.run(_run(url, workload, rate, seed, on_done, timeout))
