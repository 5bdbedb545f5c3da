"""Tenants protected from each other's load on a real server with a keys file: each tenant's
share of the queue (429 with Retry-After to the tenant over it, and only to it), per-key token
rates, the per-tenant metrics (label values from the keys file only) and the keys file's checks.
"""
from __future__ import annotations

import json

import httpx
import pytest
from live_server import MODEL, LiveServer, assert_pool_idle
from prometheus_client.parser import text_string_to_metric_families
from waiting import wait_until

from prefixserve import EngineConfig, LLMEngine
from prefixserve.entrypoints.server.app import build_app
from prefixserve.entrypoints.server.auth import KeyTable
from prefixserve.entrypoints.server.config import ServerConfig
from prefixserve.entrypoints.server.rate_limits import TokenRateLimiter

KEYS = {"key-of-heavy-001": {"tenant": "heavy", "weight": 3},
        "key-of-light-002": "light",
        "key-of-rated-003": {"tenant": "rated", "tokens_per_minute": 60},
        "key-of-admin-004": {"tenant": "ops", "admin": True},
        # rated's second key: a bucket of its own, used by the token-rate test alone
        "key-of-rated-005": {"tenant": "rated", "tokens_per_minute": 60}}
ENGINE = dict(model=MODEL, seed=0, block_size=16, num_kv_blocks=256, max_model_len=2048, max_num_seqs=1)
HOLD = {"model": MODEL, "prompt": "occupy the engine", "max_tokens": 1800, "stream": True, "ignore_eos": True}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps(KEYS))
    keys = KeyTable.from_file(path)
    # weights 3 : 1 : 1 : 1 of max_waiting 12: heavy may hold 6 in flight, every other tenant 2
    engine = LLMEngine(EngineConfig(**ENGINE, tenant_weights=keys.weights))
    with LiveServer(build_app(engine, ServerConfig(keys=keys, max_waiting=12, retry_after_s=2))) as server:
        yield server


def http(live, key: str) -> httpx.Client:
    return httpx.Client(base_url=live.base_url, timeout=60, headers={"Authorization": f"Bearer {key}"})


def tenant_samples(live) -> dict[tuple[str, str], float]:
    """(sample name, tenant) -> value of every per-tenant series on /metrics."""
    with http(live, "key-of-admin-004") as admin:
        text = admin.get("/metrics").text
    return {(s.name, s.labels["tenant"]): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if "tenant" in s.labels}


def wait_idle(live) -> None:
    wait_until(lambda: not live.in_engine(lambda e: e.has_unfinished_requests()),
               what="the disconnected requests aborted")


def test_a_flooding_tenant_gets_429s_and_the_others_keep_their_share(live):
    before = tenant_samples(live)
    streams = []
    try:
        with http(live, "key-of-light-002") as light, http(live, "key-of-heavy-001") as heavy:
            for client in (light, light):
                streams.append(client.stream("POST", "/v1/completions", json=HOLD))
                assert streams[-1].__enter__().status_code == 200
            r = light.post("/v1/completions", json={**HOLD, "stream": False})
            assert r.status_code == 429, r.text
            assert r.headers["retry-after"] == "2"
            assert "light" in r.json()["error"]["message"] and "share" in r.json()["error"]["message"]
            # light is at its share; heavy, with weight 3, still gets its six
            for _ in range(6):
                streams.append(heavy.stream("POST", "/v1/completions", json=HOLD))
                assert streams[-1].__enter__().status_code == 200
            assert heavy.post("/v1/completions", json={**HOLD, "stream": False}).status_code == 429
        with http(live, "key-of-rated-003") as rated:
            streams.append(rated.stream("POST", "/v1/completions", json={**HOLD, "max_tokens": 5}))
            assert streams[-1].__enter__().status_code == 200   # its share is untouched by the others
        after = tenant_samples(live)
        assert after[("prefixserve:tenant_requests_refused_total", "light")] == \
            before[("prefixserve:tenant_requests_refused_total", "light")] + 1
        assert after[("prefixserve:tenant_requests_refused_total", "heavy")] == \
            before[("prefixserve:tenant_requests_refused_total", "heavy")] + 1
        assert after[("prefixserve:tenant_requests_refused_total", "rated")] == \
            before[("prefixserve:tenant_requests_refused_total", "rated")]
        assert after[("prefixserve:tenant_requests_running", "light")] + \
            after[("prefixserve:tenant_requests_waiting", "light")] <= 2
    finally:
        for s in streams:
            s.__exit__(None, None, None)
    wait_idle(live)
    assert_pool_idle(live)


def test_a_keys_token_rate_is_enforced_with_retry_after(live, monkeypatch):
    wait_idle(live)
    # The buckets' clock stands still: on the real one the refill while the first request runs (seconds
    # on a loaded machine) would move the figures this test checks.
    monkeypatch.setattr(live.app.state.server, "rate_limits", TokenRateLimiter(clock=lambda: 1000.0))
    with http(live, "key-of-rated-005") as rated, http(live, "key-of-light-002") as light:
        first = rated.post("/v1/completions", json={"model": MODEL, "prompt": list(range(10, 50)),
                                                    "max_tokens": 2})
        assert first.status_code == 200, first.text
        # 40 prompt + 2 output tokens spent of 60 a minute: 40 more do not fit yet
        r = rated.post("/v1/completions", json={"model": MODEL, "prompt": list(range(60, 100)), "max_tokens": 2})
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "tokens_per_minute_exceeded"
        # 22 tokens missing at one a second
        assert int(r.headers["retry-after"]) == 22
        assert light.post("/v1/completions", json={"model": MODEL, "prompt": list(range(60, 100)),
                                                   "max_tokens": 2}).status_code == 200


def test_per_tenant_metrics_name_only_the_keys_files_tenants(live):
    wait_idle(live)
    with http(live, "key-of-light-002") as light:
        for salt in ("a-salt-of-its-own", "another"):
            r = light.post("/v1/completions", json={"model": MODEL, "prompt": list(range(100, 180)),
                                                    "max_tokens": 3, "cache_salt": salt})
            assert r.status_code == 200, r.text
    samples = tenant_samples(live)
    assert {tenant for _, tenant in samples} == {"heavy", "light", "rated", "ops"}
    assert samples[("prefixserve:tenant_tokens_served_total", "light")] >= 2 * 80
    assert samples[("prefixserve:tenant_prefix_cache_queries_total", "light")] >= 160
    engine = live.in_engine(lambda e: e.stats())
    light_stats = next(t for t in engine.tenants if t.tenant == "light")
    assert samples[("prefixserve:tenant_prefix_cache_hits_total", "light")] == light_stats.cached_prompt_tokens
    assert samples[("prefixserve:tenant_prefix_cache_hit_rate", "light")] == pytest.approx(
        light_stats.cached_prompt_tokens / light_stats.prompt_tokens)
    assert ("prefixserve:tenant_kv_evictions_total", "light") in samples


@pytest.mark.parametrize("entry, field", [({"tenant": "a", "weight": 0}, "weight"),
                                          ({"tenant": "a", "weight": True}, "weight"),
                                          ({"tenant": "a", "tokens_per_minute": -5}, "tokens_per_minute"),
                                          ({"tenant": "a", "tokens_per_minute": 1.5}, "tokens_per_minute")])
def test_bad_weights_and_rates_in_the_keys_file_are_refused_by_name(tmp_path, entry, field):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"key-number-0001": entry}))
    with pytest.raises(ValueError, match=field):
        KeyTable.from_file(path)


def test_one_tenant_with_two_weights_is_refused(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"key-number-0001": {"tenant": "a", "weight": 1},
                                "key-number-0002": {"tenant": "a", "weight": 2}}))
    with pytest.raises(ValueError, match="two weights"):
        KeyTable.from_file(path)
