"""A real server for tests: uvicorn serving an app on a free loopback port, the engine settings
most server tests share, and the checks they make of a server.

The default `server` fixture on these (tests/entrypoints/server/conftest.py) and the `client` and
`claude` fixtures (tests/conftest.py) are built from this module.
"""
from __future__ import annotations

import socket
import threading
import time
from typing import Callable

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

MODEL = "random:qwen3-tiny"
ENGINE = dict(model=MODEL, seed=0, block_size=16, num_kv_blocks=512, max_model_len=2048,
              max_num_seqs=64)


class LiveServer:
    """uvicorn serving `app` from a background thread on a port the OS picked."""

    def __init__(self, app) -> None:
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 120   # the app's startup (the engine's thread) on a loaded machine
        while not self.server.started:
            assert self.thread.is_alive(), "uvicorn exited during startup"
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        # the app's shutdown flushes the engine's KV stores (a restarted server is to find them there)
        self.thread.join(120)

    @property
    def async_llm(self):
        return self.app.state.server.async_llm

    def in_engine(self, fn: Callable):
        """Runs fn(engine) on the engine thread (the only thread allowed to touch it)."""
        return self.async_llm.submit(fn).result(timeout=60)


def metrics(http: httpx.Client) -> dict[str, float]:
    """Every sample of /metrics by name (labels dropped: one model per server)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def assert_pool_idle(server: LiveServer) -> None:
    def check(engine):
        engine.kv.check_integrity()
        return engine.stats()
    stats = server.in_engine(check)
    assert stats.blocks_in_use == 0
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.blocks_free + stats.blocks_cached == stats.blocks_total
