"""`prefixserve serve` as a user runs it: a subprocess on a free loopback port."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from prefixserve.entrypoints.cli import build_parser
from serve_process import start_serving

REPO = Path(__file__).resolve().parents[2]
RANDOM_LINE = "serving random weights"


def test_serve_parser_defaults_and_engine_options():
    args = build_parser().parse_args(["serve", "--model", "random:qwen3-tiny", "--num-kv-blocks", "64",
                                      "--max-waiting", "7"])
    assert (args.host, args.port, args.max_waiting) == ("127.0.0.1", 8000, 7)
    assert args.num_kv_blocks == 64 and args.model == "random:qwen3-tiny"


class Served:
    def __init__(self, proc: subprocess.Popen, base: str) -> None:
        self.proc, self.base, self.output = proc, base, ""


@contextmanager
def serve(*args: str) -> Iterator[Served]:
    """`prefixserve serve ARGS` on a free port, up and answering /health; stopped with SIGINT,
    which must end it with status 0. Its output is in `.output` afterwards."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc, base = start_serving(
        [sys.executable, "-m", "prefixserve", "serve", *args,
         "--num-kv-blocks", "64", "--max-model-len", "512", "--log-level", "warning"], cwd=REPO, env=env)
    served = Served(proc, base)
    try:
        yield served
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            served.output = proc.communicate(timeout=120)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            served.output = proc.communicate()[0]
    assert proc.returncode == 0, served.output


def test_serve_subcommand_answers_the_openai_client_by_either_name():
    with serve("--model", "random:qwen3-tiny", "--served-model-name", "tiny") as served:
        client = openai.OpenAI(base_url=served.base + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == ["tiny"]
        for name in ("tiny", "random:qwen3-tiny"):
            r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4)
            assert r.choices[0].finish_reason in ("stop", "length")
            assert r.model == "tiny"
        r = client.completions.create(model="random:qwen3-tiny", prompt="hi", max_tokens=2)
        assert r.model == "tiny"
        with pytest.raises(openai.NotFoundError) as refused:
            client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4)
        error = refused.value.response.json()["error"]
        assert error["param"] == "model" and "'tiny'" in error["message"]
        assert httpx.get(served.base + "/health", timeout=60).status_code == 200
    assert f"{RANDOM_LINE} (random:qwen3-tiny): outputs are noise" in served.output


def test_the_model_named_first_is_served(tiny_checkpoint):
    """`serve MODEL` as vLLM spells it: the checkpoint given first is the one loaded and listed,
    and real weights are not announced as random."""
    folder = str(tiny_checkpoint("qwen3"))
    with serve(folder) as served:
        models = httpx.get(served.base + "/v1/models", timeout=60).json()["data"]
        assert [m["id"] for m in models] == [folder]
        r = httpx.post(served.base + "/v1/completions", json={"model": folder, "prompt": "hi", "max_tokens": 2},
                       timeout=120)
        assert r.status_code == 200, r.text
    assert RANDOM_LINE not in served.output
