"""Schema fuzzing: schemathesis generates requests for every operation of the server's own
OpenAPI schema (valid ones and ones that break it on purpose) against a live server.

Oracle: no answer is a 5xx, none hangs, and afterwards the server is healthy with every KV
block free. The model is tiny and max_model_len small, so even the largest generation a
fuzzed body may ask for ends within seconds.
"""
from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from live_server import LiveServer, assert_pool_idle

from prefixserve import EngineConfig, LLMEngine
from prefixserve.entrypoints.server.app import build_app
from prefixserve.entrypoints.server.config import ServerConfig

ENGINE = dict(model="random:qwen3-tiny", seed=0, block_size=16, num_kv_blocks=256, max_model_len=256,
              max_num_seqs=16)
EXAMPLES_PER_OPERATION = 40
CALL_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def live():
    app = build_app(LLMEngine(EngineConfig(**ENGINE)), ServerConfig(max_waiting=64, render_timeout_s=5.0))
    with LiveServer(app) as server:
        yield server
        # after every fuzzed call: alive, and nothing left running or held
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            assert client.get("/health").json()["status"] == "ok"
        assert_pool_idle(server)


def test_no_operation_answers_5xx_or_hangs(live):
    schema = schemathesis.openapi.from_url(live.base_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 12  # every route of the app is in the schema
    statuses: dict[int, int] = {}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def fuzz(case) -> None:
            response = case.call(timeout=CALL_TIMEOUT_S)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])

        fuzz()
    print(f"fuzzed {len(operations)} operations with {sum(statuses.values())} calls; "
          f"statuses {sorted(statuses.items())}")
    # both sides of the schema were exercised: accepted requests and refused ones
    assert any(200 <= s < 300 for s in statuses) and any(400 <= s < 500 for s in statuses)
