"""How long one large request stalls the streams already running on a server.

    python scripts/stream_gap.py [--case long-prompt|many-messages|template-loop|huge-body|all]
    python scripts/stream_gap.py --case images [--baseline-tree DIR]

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

--case images serves random:qwen2.5-vl-tiny instead and, while the streams run, sends --images chat
requests at once, each with a different noise picture of --image-megapixels as a PNG or JPEG data URL
(alternately), resized within --image-max-pixels if given; it prints the p50, p99 and largest gap
between chunks while they were handled, next to a quiet window before; and, measured first, the CPU
time one picture sent alone costs the server process and its children (the render process). With --baseline-tree DIR the
same is measured first on a server run from the code in DIR (e.g. `git archive main prefixserve |
tar -x -C DIR`), then on this tree's.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import concurrent.futures
import io
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from typing import Optional

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TEXT_MODEL = "random:qwen3-tiny"
VISION_MODEL = "random:qwen2.5-vl-tiny"


async def stream(client: httpx.AsyncClient, stamps: list[float], stop: asyncio.Event,
                 model: str = TEXT_MODEL) -> None:
    body = {"model": model, "stream": True, "max_tokens": 3500, "ignore_eos": True,
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


def process_cpu_s(pid: int) -> float:
    """CPU seconds of a process, all its threads (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu_s(pid: int) -> float:
    """CPU seconds of the children a process's main thread started (the render process among them)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return sum(process_cpu_s(int(child)) for child in f.read().split())
    except OSError:
        return float("nan")


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


def gaps_in(stamps: list[list[float]], lo: float, hi: float) -> list[float]:
    """Every gap between two chunks of a stream that ends inside [lo, hi] (or spans it)."""
    out = []
    for s in stamps:
        for a, b in zip(s, s[1:]):
            if b >= lo and a <= hi:
                out.append(b - a)
    return out


def percentiles(gaps: list[float]) -> tuple[float, float, float]:
    """(p50, p99, max) in ms."""
    if not gaps:
        return (float("nan"),) * 3
    ordered = sorted(gaps)
    return tuple(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3 for q in (0.5, 0.99, 1.0))


def shown(figures: tuple[float, float, float]) -> str:
    return "p50 {:.1f} ms, p99 {:.1f} ms, max {:.1f} ms".format(*figures)


def picture_url(seed: int, megapixels: float, fmt: str) -> str:
    import numpy as np
    from PIL import Image
    width = int((megapixels * 1e6 * 4 / 3) ** 0.5)
    height = width * 3 // 4
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(out.getvalue()).decode()}"


async def measure_images(client: httpx.AsyncClient, args: argparse.Namespace, urls: list[str],
                         pid: int) -> tuple[float, float, float]:
    bounds = {"max_pixels": args.image_max_pixels} if args.image_max_pixels else {}

    def body(url: str) -> bytes:
        return json.dumps({"model": VISION_MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url, **bounds}},
            {"type": "text", "text": "What is it?"}]}]}).encode()

    def send(content: bytes) -> int:
        # from a thread, the body encoded beforehand: this process's event loop, which stamps the
        # streams' chunks, must not stall on megabytes of JSON itself
        with httpx.Client(base_url=str(client.base_url), timeout=120) as http:
            return http.post("/v1/chat/completions", content=content,
                             headers={"content-type": "application/json"}).status_code

    # the first picture's costs (the render process's imports, the vision tower's first run) are not measured
    await asyncio.to_thread(send, body(picture_url(len(urls), 0.05, "PNG")))
    # where a picture's work is done: each of a few other pictures sent alone, the CPU time it cost the
    # server process (the engine's prefill and vision tower included) and its children (the render process)
    server_cpu = children_cpu = 0.0
    probes = [picture_url(1000 + i, args.image_megapixels, "PNG" if i % 2 == 0 else "JPEG") for i in range(4)]
    for url in probes:
        cpu = process_cpu_s(pid), children_cpu_s(pid)
        await asyncio.to_thread(send, body(url))
        server_cpu += process_cpu_s(pid) - cpu[0]
        children_cpu += children_cpu_s(pid) - cpu[1]
    print(f"  one picture alone: {server_cpu / len(probes) * 1e3:.0f} ms CPU in the server process, "
          f"{children_cpu / len(probes) * 1e3:.0f} ms in its children (mean of {len(probes)})")
    bodies = [body(url) for url in urls]   # before the streams: encoding them stalls this loop too
    stamps: list[list[float]] = [[] for _ in range(args.streams)]
    stop = asyncio.Event()
    tasks = [asyncio.create_task(stream(client, s, stop, VISION_MODEL)) for s in stamps]
    await asyncio.sleep(3.0)  # streams under way
    loop = asyncio.get_running_loop()
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as senders:
        t0 = time.perf_counter()
        codes = await asyncio.gather(*(loop.run_in_executor(senders, send, content) for content in bodies))
    t1 = time.perf_counter()
    await asyncio.sleep(0.5)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    window = t1 - t0
    quiet = percentiles(gaps_in(stamps, t0 - window - 0.5, t0 - 0.5))
    busy = percentiles(gaps_in(stamps, t0, t1))
    print(f"  {len(urls)} image requests answered {sorted(set(codes))} in {window * 1e3:.0f} ms; gaps between chunks "
          f"of {args.streams} stream(s): quiet window before {shown(quiet)}; while handled {shown(busy)}")
    return busy


async def main(args: argparse.Namespace) -> None:
    if args.case == "images":
        urls = [picture_url(i, args.image_megapixels, "PNG" if i % 2 == 0 else "JPEG") for i in range(args.images)]
        trees = ([(f"baseline tree {args.baseline_tree}", args.baseline_tree)] if args.baseline_tree else []) + \
            [("this tree", None)]
        busy: dict[str, list[tuple[float, float, float]]] = {name: [] for name, _ in trees}
        for round_ in range(args.rounds):
            for name, tree in trees:
                print(f"{name} (round {round_ + 1}):")
                busy[name].append(await serve_and_measure(args, args.offload_body_bytes, tree=tree, urls=urls))
        print(f"medians over {args.rounds} round(s) of the gaps while the pictures were handled:")
        for name, rounds in busy.items():
            print(f"  {name}: " + shown(tuple(statistics.median(r[i] for r in rounds) for i in range(3))))
        return
    for offload in ([64 * 2**10, 2**40] if args.compare_offload else [args.offload_body_bytes]):
        print(f"--offload-body-bytes {offload}")
        await serve_and_measure(args, offload)


async def serve_and_measure(args: argparse.Namespace, offload_body_bytes: int, tree: str | None = None,
                            urls: list[str] | None = None) -> Optional[tuple[float, float, float]]:
    port = free_port()
    env = os.environ.copy()
    if tree is not None:  # another tree's code; write no bytecode into it
        env.update(PYTHONPATH=os.path.abspath(tree), PYTHONDONTWRITEBYTECODE="1")
    # `python -m` imports from its working folder before PYTHONPATH: run it in the tree it is to serve
    cwd = os.path.abspath(tree) if tree is not None else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-m", "prefixserve", "serve",
                             "--model", VISION_MODEL if urls is not None else TEXT_MODEL, "--port", str(port),
                             "--log-level", "warning", "--max-num-seqs", "8", "--trust-request-chat-template",
                             "--max-messages", str(args.max_messages),
                             "--offload-body-bytes", str(offload_body_bytes)], env=env, cwd=cwd)
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
            if urls is not None:
                return await measure_images(client, args, urls, proc.pid)
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
    parser.add_argument("--case", choices=CASES + ["all", "images"], default="all",
                        help="all: the text cases; images: on a vision model, a burst of large pictures")
    parser.add_argument("--max-messages", type=int, default=100_000,
                        help="the server's bound (default high, so that many-messages is rendered, not refused)")
    parser.add_argument("--offload-body-bytes", type=int, default=64 * 2**10)
    parser.add_argument("--compare-offload", action="store_true",
                        help="run every case on a server parsing large bodies in the render process, then on one "
                             "parsing them on the event loop")
    parser.add_argument("--images", type=int, default=4, help="images: requests in the burst, one picture each")
    parser.add_argument("--image-megapixels", type=float, default=1.5)
    parser.add_argument("--image-max-pixels", type=int,
                        help="images: each picture's resizing budget (the image_url max_pixels extension): a "
                             "small one keeps the engine's share (prefill, vision tower) small")
    parser.add_argument("--baseline-tree", help="images: also measure a server run from the code in this folder, "
                                                "first")
    parser.add_argument("--rounds", type=int, default=1, help="images: measure each tree this many times, "
                                                              "alternating")
    asyncio.run(main(parser.parse_args()))
