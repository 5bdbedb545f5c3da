"""`prefixserve serve --kv-store`: a real server process, its /metrics, and a restart.

The first server's answers are checked against an offline engine with prefix caching off;
it is stopped cleanly (SIGINT), which flushes its pool to the file store; a second server on
the same store must answer the same prompt with its full blocks cached."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kv_store_helpers import BLOCK, PARAMS, documents, full_blocks, reference
from redis_server import free_port


class ServeProcess:
    def __init__(self, model: str, stores: list[str]) -> None:
        self.port = free_port()
        args = [sys.executable, "-m", "prefixserve", "serve", "--model", model, "--dtype", "float32",
                "--port", str(self.port), "--num-kv-blocks", "64", "--log-level", "warning",
                "--served-model-name", "m"]
        for url in stores:
            args += ["--kv-store", url]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, self.proc.stdout.read()
            assert time.monotonic() < deadline, "server did not start"
            try:
                if httpx.get(self.base + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)

    def complete(self, tokens: list[int]) -> dict:
        r = httpx.post(self.base + "/v1/completions", timeout=120, json={
            "model": "m", "prompt": tokens, "max_tokens": PARAMS.max_tokens, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()

    def metrics(self) -> dict[tuple[str, str], float]:
        out = {}
        for family in text_string_to_metric_families(httpx.get(self.base + "/metrics").text):
            for s in family.samples:
                if "store" in s.labels:
                    out[(s.name, s.labels["store"])] = s.value
        return out

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(120)


@pytest.fixture(scope="module")
def model(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("qwen3"))


def test_a_restarted_server_answers_from_the_file_store(tmp_path, model):
    from prefixserve import LLM

    doc = documents(1, 120, seed=11)[0]
    tokenizer = LLM(model, dtype="float32", num_kv_blocks=16).tokenizer
    want = tokenizer.decode(reference([doc], model)[0])
    url = f"file://{tmp_path}"
    first = ServeProcess(model, [url, "mem://?size=1MiB"])
    try:
        a = first.complete(doc)
        m = first.metrics()
        store = f"file://{tmp_path}"
        assert m[("prefixserve:kv_store_hits_total", store)] == 0
        assert m[("prefixserve:kv_store_errors_total", "mem://?size=1MiB")] == 0
        assert m[("prefixserve:kv_store_records", store)] == 0
    finally:
        first.stop()
    assert first.proc.returncode == 0
    assert a["choices"][0]["text"] == want
    assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert list(tmp_path.rglob("*.kvb"))   # flushed at shutdown

    second = ServeProcess(model, [url])
    try:
        b = second.complete(doc)
        m = second.metrics()
    finally:
        second.stop()
    assert b["choices"][0]["text"] == want
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == full_blocks(doc)
    assert m[("prefixserve:kv_store_hits_total", url)] == full_blocks(doc) // BLOCK
    assert m[("prefixserve:kv_store_bytes_read_total", url)] > 0
