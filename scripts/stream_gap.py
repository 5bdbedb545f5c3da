"""How long one large request stalls the streams already running on a server.

    python scripts/stream_gap.py [--prompt-tokens 30000] [--streams 4]

Starts `prefixserve serve` on random:qwen3-tiny on a free loopback port, opens N streaming
chat completions, and while they run sends one chat whose user message renders to about
--prompt-tokens tokens (refused as too long for the model, after it has been rendered and
tokenized: that work is what could block the server). Prints the largest gap between two
chunks of any running stream while the large request was being handled, next to the largest
gap in a quiet window of the same length just before it.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def stream(client: httpx.AsyncClient, stamps: list[float], stop: asyncio.Event) -> None:
    body = {"model": "random:qwen3-tiny", "stream": True, "max_tokens": 3500, "ignore_eos": True,
            "temperature": 0, "messages": [{"role": "user", "content": "Tell me a long story."}]}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                stamps.append(time.perf_counter())
            if stop.is_set():
                break


def largest_gap(stamps: list[list[float]], lo: float, hi: float) -> float:
    worst = 0.0
    for s in stamps:
        inside = [t for t in s if lo <= t <= hi]
        before = [t for t in s if t < lo][-1:]
        after = [t for t in s if t > hi][:1]
        seq = before + inside + after
        worst = max([worst] + [b - a for a, b in zip(seq, seq[1:])])
    return worst


async def main(args: argparse.Namespace) -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "prefixserve.entrypoints.cli", "serve",
                             "--model", "random:qwen3-tiny", "--port", str(port), "--log-level",
                             "warning", "--max-num-seqs", "8"], env=os.environ.copy())
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=base, timeout=120) as client:
            for _ in range(600):
                try:
                    if (await client.get("/health")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.1)
            rng = random.Random(0)
            words = ["cache", "block", "prefix", "token", "engine", "stream", "server", "model"]
            text = " ".join(rng.choice(words) + str(rng.randrange(1000)) for _ in range(args.prompt_tokens * 10 // 39))
            stamps: list[list[float]] = [[] for _ in range(args.streams)]
            stop = asyncio.Event()
            tasks = [asyncio.create_task(stream(client, s, stop)) for s in stamps]
            await asyncio.sleep(2.0)  # streams under way
            t0 = time.perf_counter()
            r = await client.post("/v1/chat/completions", json={
                "model": "random:qwen3-tiny", "max_tokens": 4,
                "messages": [{"role": "user", "content": text}]})
            t1 = time.perf_counter()
            await asyncio.sleep(0.5)
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            window = t1 - t0
            quiet = largest_gap(stamps, t0 - window - 0.2, t0 - 0.2)
            busy = largest_gap(stamps, t0, t1)
            print(f"large request: {len(text)} chars, answered {r.status_code} in {window * 1e3:.0f} ms "
                  f"({r.json().get('error', {}).get('message', '')[:80]!r})")
            print(f"largest gap between chunks of {args.streams} streams: quiet window {quiet * 1e3:.1f} ms, "
                  f"while the large request was handled {busy * 1e3:.1f} ms")
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=30000)
    parser.add_argument("--streams", type=int, default=4)
    asyncio.run(main(parser.parse_args()))
