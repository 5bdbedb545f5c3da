"""`prefixserve serve --kv-store`: a real server process, its /metrics, and a restart.

The first server's answers are checked against an offline engine with prefix caching off;
it is stopped cleanly (SIGINT), which flushes its pool to the file store; a second server on
the same store must answer the same prompt with its full blocks cached."""
from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys

import httpx
import pytest
import xxhash
from prometheus_client.parser import text_string_to_metric_families

from kv_store_helpers import BLOCK, PARAMS, documents, full_blocks, reference
from redis_server import free_port
from serve_process import start_serving


class ServeProcess:
    def __init__(self, model: str, stores: list[str], env: dict | None = None) -> None:
        args = [sys.executable, "-m", "prefixserve", "serve", "--model", model, "--dtype", "float32",
                "--num-kv-blocks", "64", "--log-level", "warning", "--served-model-name", "m"]
        for url in stores:
            args += ["--kv-store", url]
        self.proc, self.base = start_serving(args, env={**os.environ, **(env or {})})

    def complete(self, tokens: list[int]) -> dict:
        r = httpx.post(self.base + "/v1/completions", timeout=120, json={
            "model": "m", "prompt": tokens, "max_tokens": PARAMS.max_tokens, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()

    def metrics(self) -> dict[tuple[str, str], float]:
        out = {}
        for family in text_string_to_metric_families(httpx.get(self.base + "/metrics", timeout=60).text):
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


def serve_args(model: str, store: str) -> list[str]:
    return [sys.executable, "-m", "prefixserve", "serve", "--model", model, "--port",
            str(free_port()), "--kv-store", store]


def test_a_server_refuses_a_literal_key_at_start(tmp_path, model):
    literal = subprocess.run(serve_args(model, f"file://{tmp_path}?mac_key=hunter2hunter2hunter2"),
                             capture_output=True, text=True, timeout=120)
    assert literal.returncode != 0 and "never given on the command line" in literal.stderr
    assert "hunter2" not in literal.stderr


def test_a_server_with_a_keyed_store_counts_forged_records_in_its_metrics(tmp_path, model):
    from prefixserve import LLM

    doc = documents(1, 120, seed=12)[0]
    env = {"PS_KV_TEST_KEY": os.urandom(24).hex()}
    url = f"file://{tmp_path}"
    # The records an engine with no key writes (a server's writes are the engine's).
    with LLM(model, dtype="float32", num_kv_blocks=64, kv_stores=[url]) as llm:
        want = llm.tokenizer.decode(llm.generate({"prompt_token_ids": doc}, PARAMS)[0].outputs[0].token_ids)
    assert want == llm.tokenizer.decode(reference([doc], model)[0])
    # Whoever can write the directory but lacks the key: every record rewritten, K/V zeroed,
    # checksum recomputed.
    records = list(tmp_path.rglob("*.kvb"))
    for path in records:
        data = path.read_bytes()
        (header_len,) = struct.unpack_from("<I", data, 6)
        head = data[:10 + header_len]
        body = head + bytes(len(data) - len(head) - 16)
        path.write_bytes(body + xxhash.xxh3_128(body).digest())
    second = ServeProcess(model, [f"{url}?mac_key_env=PS_KV_TEST_KEY"], env)
    try:
        b = second.complete(doc)
        m = second.metrics()
    finally:
        second.stop()
    assert b["choices"][0]["text"] == want
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert m[("prefixserve:kv_store_forged_total", url)] == m[("prefixserve:kv_store_rejected_total", url)] >= 1
    assert m[("prefixserve:kv_store_hits_total", url)] == 0
