"""How long one large request stalls the streams already running on a server.

    python scripts/stream_gap.py [--case long-prompt|many-messages|template-loop|huge-body|all]

Starts `prefixserve serve` on random:qwen3-tiny on a free loopback port (trusting client chat
templates, so that the template case is run rather than refused), opens N streaming chat
completions, and while they run sends one large request:
- long-prompt: a chat whose user message renders to about --prompt-tokens tokens (refused as
  too long for the model, after it has been rendered and tokenized);
- many-messages: a chat of 20,000 short messages;
- template-loop: a client chat template that loops for ever (stopped by the render timeout);
- huge-body: a 10 MB prompt (beyond the body bound).
Prints the largest gap between two chunks of any running stream while the large request was
handled, next to the largest gap in a quiet window of the same length just before it, and the
CPU time the server's event-loop thread spent in both windows (from /proc's schedstat: unlike
the gaps, it does not grow when other jobs share the cores). With --compare-offload the server is
started twice, parsing large bodies in the render process and on the event loop.
"""
from __future__ import annotations

import argparse
import asyncio
import json
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


CASES = ["long-prompt", "many-messages", "template-loop", "huge-body"]


def large_request(case: str, prompt_tokens: int) -> dict:
    rng = random.Random(0)
    words = ["cache", "block", "prefix", "token", "engine", "stream", "server", "model"]
    body = {"model": "random:qwen3-tiny", "max_tokens": 4}
    if case == "long-prompt":
        text = " ".join(rng.choice(words) + str(rng.randrange(1000)) for _ in range(prompt_tokens * 10 // 39))
        return {**body, "messages": [{"role": "user", "content": text}]}
    if case == "many-messages":
        return {**body, "messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": rng.choice(words)}
                                     for i in range(20_000)]}
    if case == "template-loop":
        return {**body, "messages": [{"role": "user", "content": "hi"}],
                "chat_template": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"}
    if case == "huge-body":
        return {**body, "messages": [{"role": "user", "content": "x" * 10_000_000}]}
    raise ValueError(case)


def loop_cpu_s(pid: int) -> float:
    """CPU seconds of the server's main thread, which runs the event loop."""
    with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


async def measure(client: httpx.AsyncClient, case: str, args: argparse.Namespace, pid: int) -> None:
    body = large_request(case, args.prompt_tokens)
    stamps: list[list[float]] = [[] for _ in range(args.streams)]
    stop = asyncio.Event()
    tasks = [asyncio.create_task(stream(client, s, stop)) for s in stamps]
    await asyncio.sleep(2.0)  # streams under way
    content = json.dumps(body).encode()
    t0 = time.perf_counter()
    cpu0 = loop_cpu_s(pid)
    r = await client.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
    t1 = time.perf_counter()
    cpu1 = loop_cpu_s(pid)
    await asyncio.sleep(t1 - t0)  # a quiet window of the same length after it
    cpu2 = loop_cpu_s(pid)
    await asyncio.sleep(0.5)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    window = max(t1 - t0, 0.05)
    quiet = largest_gap(stamps, t0 - window - 0.2, t0 - 0.2)
    busy = largest_gap(stamps, t0, t1)
    message = r.json().get("error", {}).get("message", "") if r.status_code >= 400 else ""
    print(f"{case}: answered {r.status_code} in {(t1 - t0) * 1e3:.0f} ms {message[:70]!r}; largest gap between "
          f"chunks of {args.streams} streams: quiet {quiet * 1e3:.1f} ms, while it was handled {busy * 1e3:.1f} ms; "
          f"event-loop CPU while handled {(cpu1 - cpu0) * 1e3:.0f} ms, in a quiet window as long "
          f"{(cpu2 - cpu1) * 1e3:.0f} ms")


async def main(args: argparse.Namespace) -> None:
    for offload in ([64 * 2**10, 2**40] if args.compare_offload else [args.offload_body_bytes]):
        print(f"--offload-body-bytes {offload}")
        await serve_and_measure(args, offload)


async def serve_and_measure(args: argparse.Namespace, offload_body_bytes: int) -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "prefixserve", "serve",
                             "--model", "random:qwen3-tiny", "--port", str(port), "--log-level",
                             "warning", "--max-num-seqs", "8", "--trust-request-chat-template",
                             "--max-messages", str(args.max_messages),
                             "--offload-body-bytes", str(offload_body_bytes)], env=os.environ.copy())
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
            cases = CASES if args.case == "all" else [args.case]
            for case in cases:
                await measure(client, case, args, proc.pid)
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=30000)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--case", choices=CASES + ["all"], default="all")
    parser.add_argument("--max-messages", type=int, default=100_000,
                        help="the server's bound (default high, so that many-messages is rendered, not refused)")
    parser.add_argument("--offload-body-bytes", type=int, default=64 * 2**10)
    parser.add_argument("--compare-offload", action="store_true",
                        help="run every case on a server parsing large bodies in the render process, then on one "
                             "parsing them on the event loop")
    asyncio.run(main(parser.parse_args()))
