"""Soak a `prefixserve serve` process with mixed traffic and watch its memory.

    python scripts/soak.py --minutes 10 [--model random:qwen3-tiny] [--concurrency 6]

Starts the server on a free loopback port and sends, from `--concurrency` clients at once,
completions and chat completions (streamed and not) over prompts of many distinct lengths,
chats sharing a few long system prompts, n > 1, Anthropic Messages, streams closed after a
few events (the server must abort them), and named cached contents created, used and deleted.

Every `--report-every` finished requests it prints the server's RSS (/proc/PID/status), the
render child's RSS, the server's threads and open files, and what /metrics and
/v1/cached_contents show: KV blocks in use / cached / pinned, requests running and waiting,
cached contents. After `--warmup-requests` it compares RSS with the first report after the
warm-up; at the end it waits for the server to go idle and checks that no KV block is in use.
Not a test: it prints, and exits non-zero only when the server dies or the idle check fails.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
         "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu cache block "
         "token prefix stream server memory engine request model layer kernel paged batch").split()
TOKEN_IDS = range(300, 3000)   # plain tokens of the shipped tokenizer
MAX_PROMPT_TOKENS = 1500


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS (kB), Threads and open fds of a process; empty once it is gone."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "Threads"):
                    out[key] = int(value.split()[0])
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return {}
    return out


def children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids += [int(k) for k in f.read().split()]
    except FileNotFoundError:
        pass
    return kids


_METRIC = re.compile(r"^prefixserve:(\w+)\{[^}]*\} ([0-9.e+-]+)$")
GAUGES = ("kv_blocks_in_use", "kv_blocks_cached", "kv_blocks_pinned", "num_requests_running",
          "num_requests_waiting")


async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    text = (await client.get("/metrics")).text
    values = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m and m.group(1) in GAUGES:
            values[m.group(1)] = float(m.group(2))
    values["cached_contents"] = len((await client.get("/v1/cached_contents")).json()["data"])
    return values


@dataclass
class Tally:
    done: int = 0
    kinds: Counter = field(default_factory=Counter)
    statuses: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)


class Traffic:
    """One client's request mix; every call of `one()` sends one request (or a content's life)."""

    def __init__(self, client: httpx.AsyncClient, model: str, rng: random.Random, tally: Tally,
                 lengths: list[int]) -> None:
        self.client, self.model, self.rng, self.tally, self.lengths = client, model, rng, tally, lengths
        self.systems = [" ".join(rng.choice(WORDS) for _ in range(n)) for n in (300, 600, 900)]

    def words(self, n: int) -> str:
        # a fifth of the words made up, so the text side sees new strings too
        rng = self.rng
        return " ".join(rng.choice(WORDS) if rng.random() < 0.8
                        else "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9)))
                        for _ in range(n))

    def token_prompt(self) -> list[int]:
        # lengths are drawn from a shuffled cycle, so every length in range comes up
        if not self.lengths:
            self.lengths.extend(range(1, MAX_PROMPT_TOKENS + 1))
            self.rng.shuffle(self.lengths)
        return [self.rng.choice(TOKEN_IDS) for _ in range(self.lengths.pop())]

    def count(self, kind: str, status: int) -> None:
        self.tally.done += 1
        self.tally.kinds[kind] += 1
        self.tally.statuses[status] += 1

    async def post(self, kind: str, path: str, body: dict) -> httpx.Response:
        r = await self.client.post(path, json=body)
        self.count(kind, r.status_code)
        return r

    async def stream(self, kind: str, path: str, body: dict, stop_after: int | None) -> None:
        """Reads the event stream; with stop_after, closes the connection after that many events."""
        events = 0
        async with self.client.stream("POST", path, json=body) as r:
            status = r.status_code
            async for line in r.aiter_lines():
                if line.startswith("data:") or line.startswith("event:"):
                    events += 1
                    if stop_after is not None and events >= stop_after:
                        break
        self.count(kind + ("-closed" if stop_after is not None else ""), status)

    def sampling(self) -> dict:
        return {"max_tokens": self.rng.randint(1, 24), "temperature": self.rng.choice([0.0, 0.8, 1.0]),
                "n": self.rng.choice([1, 1, 1, 2, 3])}

    async def one(self) -> None:
        rng = self.rng
        pick = rng.random()
        if pick < 0.25:
            body = {"model": self.model, "prompt": self.token_prompt(), **self.sampling()}
            await self.post("completion", "/v1/completions", body)
        elif pick < 0.40:
            body = {"model": self.model, "prompt": self.token_prompt(), "stream": True, **self.sampling(),
                    "max_tokens": rng.randint(4, 32)}
            await self.stream("completion-stream", "/v1/completions", body,
                              stop_after=rng.randint(1, 3) if rng.random() < 0.4 else None)
        elif pick < 0.60:
            messages = [{"role": "system", "content": rng.choice(self.systems)},
                        {"role": "user", "content": self.words(rng.randint(1, 300))}]
            body = {"model": self.model, "messages": messages, **self.sampling()}
            await self.post("chat", "/v1/chat/completions", body)
        elif pick < 0.80:
            messages = [{"role": "system", "content": rng.choice(self.systems)},
                        {"role": "user", "content": self.words(rng.randint(1, 300))}]
            body = {"model": self.model, "messages": messages, "stream": True, **self.sampling(),
                    "stream_options": {"include_usage": True}}
            await self.stream("chat-stream", "/v1/chat/completions", body,
                              stop_after=rng.randint(1, 3) if rng.random() < 0.4 else None)
        elif pick < 0.92:
            body = {"model": self.model, "max_tokens": rng.randint(1, 16),
                    "system": rng.choice(self.systems),
                    "messages": [{"role": "user", "content": self.words(rng.randint(1, 400))}],
                    "stream": rng.random() < 0.5}
            if body["stream"]:
                await self.stream("messages-stream", "/v1/messages", body,
                                  stop_after=rng.randint(1, 4) if rng.random() < 0.3 else None)
            else:
                await self.post("messages", "/v1/messages", body)
        else:
            await self.content_life()

    async def content_life(self) -> None:
        """Create a named content, chat over it 1-3 times, delete it."""
        name = f"soak-{self.rng.getrandbits(64):016x}"
        r = await self.post("content-create", "/v1/cached_contents", {
            "model": self.model, "name": name, "system": self.words(self.rng.randint(50, 600)),
            "messages": [{"role": "user", "content": self.words(20)},
                         {"role": "assistant", "content": self.words(10)}], "ttl": "10m"})
        if r.status_code != 200:
            self.tally.errors[f"content-create {r.status_code}: {r.text[:120]}"] += 1
            return
        for _ in range(self.rng.randint(1, 3)):
            body = {"model": self.model, "cached_content": name, "max_tokens": self.rng.randint(1, 16),
                    "messages": [{"role": "user", "content": self.words(self.rng.randint(1, 100))}],
                    "stream": self.rng.random() < 0.5}
            if body["stream"]:
                await self.stream("content-chat-stream", "/v1/chat/completions", body, stop_after=None)
            else:
                await self.post("content-chat", "/v1/chat/completions", body)
        r = await self.client.delete(f"/v1/cached_contents/{name}")
        self.count("content-delete", r.status_code)


async def client_loop(traffic: Traffic, until: float) -> None:
    while time.monotonic() < until:
        try:
            await traffic.one()
        except httpx.HTTPError as exc:
            traffic.tally.errors[f"{type(exc).__name__}: {str(exc)[:80]}"] += 1
            await asyncio.sleep(0.1)


def fmt_report(done: int, elapsed: float, server: dict, child_rss: int, metrics: dict, base: int | None) -> str:
    rss = server.get("VmRSS", 0) / 1024
    change = "" if base is None else f" ({100 * (server.get('VmRSS', 0) - base) / base:+5.1f}%)"
    return (f"{done:>7} {elapsed:>7.0f} {rss:>8.1f}{change:<9} {child_rss / 1024:>8.1f} "
            f"{server.get('Threads', 0):>4} {server.get('fds', 0):>4} "
            f"{metrics.get('kv_blocks_in_use', -1):>6.0f} {metrics.get('kv_blocks_cached', -1):>6.0f} "
            f"{metrics.get('kv_blocks_pinned', -1):>6.0f} {metrics.get('num_requests_running', -1):>4.0f} "
            f"{metrics.get('num_requests_waiting', -1):>4.0f} {metrics.get('cached_contents', -1):>5.0f}")


HEADER = (f"{'reqs':>7} {'secs':>7} {'RSS MB':>8}{'(vs base)':<9} {'child MB':>8} {'thr':>4} {'fds':>4} "
          f"{'kv_use':>6} {'kv_cch':>6} {'kv_pin':>6} {'run':>4} {'wait':>4} {'cntnt':>5}")


async def run(args: argparse.Namespace, pid: int, base_url: str) -> bool:
    tally = Tally()
    lengths: list[int] = []
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    timeout = httpx.Timeout(120.0)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:
        rng = random.Random(args.seed)
        start = time.monotonic()
        until = start + args.minutes * 60
        clients = [asyncio.create_task(client_loop(
            Traffic(client, args.model, random.Random(rng.getrandbits(64)), tally, lengths), until))
            for _ in range(args.concurrency)]
        print(HEADER, flush=True)
        next_report, base, after_warmup = args.report_every, None, []
        while not all(c.done() for c in clients):
            await asyncio.sleep(0.2)
            if tally.done >= next_report:
                next_report += args.report_every
                server = proc_status(pid)
                if not server:
                    print("the server process is gone", flush=True)
                    return False
                child_rss = sum(proc_status(k).get("VmRSS", 0) for k in children(pid))
                metrics = await scrape(client)
                if base is None and tally.done >= args.warmup_requests:
                    base = server["VmRSS"]
                    print(f"-- warm-up over: base RSS {base / 1024:.1f} MB", flush=True)
                elif base is not None:
                    after_warmup.append(server["VmRSS"])
                print(fmt_report(tally.done, time.monotonic() - start, server, child_rss, metrics, base),
                      flush=True)
        for c in clients:
            c.result()

        # idle: nothing running or waiting, then every block must be free
        deadline = time.monotonic() + 60
        while True:
            metrics = await scrape(client)
            if metrics.get("num_requests_running") == 0 and metrics.get("num_requests_waiting") == 0:
                break
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(1.0)
        metrics = await scrape(client)
        server = proc_status(pid)
        child_rss = sum(proc_status(k).get("VmRSS", 0) for k in children(pid))
        print("-- idle at the end:", flush=True)
        print(fmt_report(tally.done, time.monotonic() - start, server, child_rss, metrics, base), flush=True)

    print(f"requests by kind: {dict(sorted(tally.kinds.items()))}")
    print(f"HTTP statuses: {dict(sorted(tally.statuses.items()))}")
    if tally.errors:
        print(f"client errors: {dict(tally.errors.most_common(10))}")
    if base is not None and after_warmup:
        lo, hi = min(after_warmup), max(after_warmup)
        print(f"RSS after warm-up: base {base / 1024:.1f} MB, min {lo / 1024:.1f}, max {hi / 1024:.1f}, "
              f"last {after_warmup[-1] / 1024:.1f} ({100 * (hi - base) / base:+.1f}% at most; goal within 5%)")
    else:
        print("RSS after warm-up: not enough requests for a comparison (lower --warmup-requests)")
    idle_ok = metrics.get("kv_blocks_in_use") == 0
    print(f"KV blocks in use when idle: {metrics.get('kv_blocks_in_use'):.0f} "
          f"({'ok' if idle_ok else 'NOT 0'}); pinned {metrics.get('kv_blocks_pinned'):.0f}, "
          f"cached contents {metrics.get('cached_contents'):.0f}")
    return idle_ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--model", default="random:qwen3-tiny")
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--warmup-requests", type=int, default=2000)
    parser.add_argument("--report-every", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-arg", action="append", default=[],
                        help="extra argument for `prefixserve serve` (repeatable)")
    args = parser.parse_args()

    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="soak-server-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "prefixserve.entrypoints.cli", "serve", "--model", args.model,
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *args.server_arg]
    print(f"starting: {' '.join(cmd)} (log: {log.name})", flush=True)
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[1])
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                print(f"the server exited with {server.returncode}; see {log.name}")
                return 1
            try:
                if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                print("the server did not become healthy in 300 s")
                return 1
            time.sleep(0.5)
        print(f"server pid {server.pid} healthy on {base_url}; "
              f"RSS {proc_status(server.pid).get('VmRSS', 0) / 1024:.1f} MB before traffic", flush=True)
        ok = asyncio.run(run(args, server.pid, base_url))
        if server.poll() is not None:
            print(f"the server exited with {server.returncode}; see {log.name}")
            return 1
        return 0 if ok else 1
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


if __name__ == "__main__":
    sys.exit(main())
