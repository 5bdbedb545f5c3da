"""Online mode against a live `prefixserve` server: Poisson arrivals, streamed TTFT, cache hits reported."""
from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
import uvicorn

from prefixserve import EngineConfig, LLMEngine
from prefixserve.benchmarks.figures import figures_of
from prefixserve.benchmarks.online import run_online
from prefixserve.benchmarks.workloads import build_workload
from prefixserve.entrypoints.server.app import build_app


@pytest.fixture(scope="module")
def base_url():
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(LLMEngine(EngineConfig(model="random:qwen3-tiny"))),
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(30)


def test_online_run_measures_every_request(base_url: str) -> None:
    w = build_workload("long-doc-qa", quick=True)
    doc_blocks = 256 // 16 * 16   # the questions share their first 256 tokens: the document
    # The document cached first: Poisson arrivals can overlap (on a loaded machine a question can
    # arrive before the one before it was computed), and then what it found would depend on timing.
    warm = httpx.post(base_url + "/v1/completions", timeout=120, json={
        "model": "random:qwen3-tiny", "prompt": list(w.requests[0].prompt_token_ids[:doc_blocks]), "max_tokens": 1})
    assert warm.status_code == 200, warm.text
    done = []
    run = run_online(base_url, w, rate=2.0, seed=5, on_done=lambda: done.append(1))
    assert len(done) == len(run.records) == len(w.requests)
    for rec in run.records:
        assert len(rec.output_token_ids) == 4       # ignore_eos honoured: exactly max_tokens
        assert 0 < rec.ttft_s <= rec.e2e_s
    # Every question finds the document's full blocks cached on the server, and no more.
    assert [r.cached_tokens for r in run.records] == [doc_blocks] * len(w.requests)
    f = figures_of(run, w)
    assert f.requests == len(w.requests) and f.ideal_s is None


def test_online_rejects_bad_arguments() -> None:
    w = build_workload("no-sharing", quick=True)
    with pytest.raises(ValueError, match="rate must be > 0"):
        run_online("http://127.0.0.1:1", w, rate=0)
    with pytest.raises(ValueError, match="must start with http"):
        run_online("127.0.0.1:1", w, rate=1)
