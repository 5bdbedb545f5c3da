"""`prefixserve serve` as a user runs it: a subprocess on a free loopback port."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from prefixserve.benchmarks.serving_process import free_port
from prefixserve.entrypoints.cli import build_parser

REPO = Path(__file__).resolve().parents[2]


def test_serve_parser_defaults_and_engine_options():
    args = build_parser().parse_args(["serve", "--model", "random:qwen3-tiny", "--num-kv-blocks", "64",
                                      "--max-waiting", "7"])
    assert (args.host, args.port, args.max_waiting) == ("127.0.0.1", 8000, 7)
    assert args.num_kv_blocks == 64 and args.model == "random:qwen3-tiny"


def test_serve_subcommand_answers_the_openai_client():
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixserve.entrypoints.cli", "serve", "--model", "random:qwen3-tiny",
         "--port", str(port), "--num-kv-blocks", "64", "--max-model-len", "512",
         "--served-model-name", "tiny", "--log-level", "warning"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == ["tiny"]
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4)
        assert r.choices[0].finish_reason in ("stop", "length")
        assert r.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out = proc.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            out = proc.communicate()[0]
    assert proc.returncode == 0, out
