"""The server most of these tests talk to: the shared engine settings (tests/live_server.py ENGINE)
behind ServerConfig(max_waiting=64), one per test module. A module whose server differs (its
own engine, clock, keys or server settings) defines its own `server` fixture, which takes
precedence; the `client` and `claude` fixtures of tests/conftest.py use whichever it gets."""
from __future__ import annotations

import httpx
import pytest
from live_server import ENGINE, LiveServer

from prefixserve import EngineConfig, LLMEngine
from prefixserve.entrypoints.server.app import build_app
from prefixserve.entrypoints.server.config import ServerConfig


@pytest.fixture(scope="module")
def server():
    app = build_app(LLMEngine(EngineConfig(**ENGINE)), ServerConfig(max_waiting=64))
    with LiveServer(app) as live:
        yield live


@pytest.fixture()
def http(server):
    """Raw httpx on the module's `server`."""
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c
