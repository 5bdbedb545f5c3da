"""Replicas sharing a Redis KV store (a real redis-server started here): a prefix one replica
computed is served by the other from the store, and answers as with caching off."""
import contextlib

import httpx
import pytest

from prefixserve.engine import LLM, EngineConfig
from prefixserve.entrypoints.server.app import build_app
from prefixserve.entrypoints.server.config import ServerConfig
from prefixserve.kv.stores import open_store
from prefixserve.replicas.policy import RoutingConfig
from prefixserve.replicas.service import ReplicaConfig, ReplicaService
from prefixserve.sampling_params import SamplingParams
from live_server import LiveServer
from replica_service import ENGINE, cached, routing
from waiting import wait_until

pytestmark = pytest.mark.slow
PROMPT = [(i * 37) % 900 + 20 for i in range(200)]   # 12 full blocks of 16, one partial


def ask(live) -> dict:
    body = {"model": "random:qwen3-tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    r = httpx.post(live.base_url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@contextlib.contextmanager
def store_service(redis_url: str, router: str, app_name: str):
    """2 replicas writing through to one Redis, served over HTTP: (front, live server, store client)."""
    engine = EngineConfig(**ENGINE, kv_stores=[redis_url], kv_store_write="through")
    service = ReplicaService(engine, ReplicaConfig(
        num_replicas=2, replica_cpus=0.5, app_name=app_name, health_check_period_s=1.0,
        routing=RoutingConfig(router=router)), max_waiting=64)
    front = service.start()
    store = open_store(redis_url)
    try:
        with LiveServer(build_app(front, ServerConfig(max_waiting=64))) as live:
            yield front, live, store
    finally:
        store.close()
        service.stop()


def test_a_replica_serves_the_other_replicas_prefix_from_the_store(cluster, redis_server):
    # Round-robin sends the second request to the replica that did not compute the prefix.
    with store_service(redis_server.url, "round-robin", "store") as (front, live, store):
        first = ask(live)
        # Write-through lands in the background: wait until Redis holds every full block
        # the engine would look up (the block holding the last prompt token is never looked up).
        wait_until(lambda: store.usage()[0] >= (len(PROMPT) - 1) // 16)
        second = ask(live)
        wait_until(lambda: sum(s["prompt_tokens"] for s in front.replica_stats().values())
                 == 2 * len(PROMPT))
        stats = front.replica_stats()
    assert cached(first) == 0
    assert cached(second) == (len(PROMPT) - 1) // 16 * 16
    # Each replica served one request; only the second one's came from Redis.
    assert sorted(s["prompt_tokens"] for s in stats.values()) == [len(PROMPT)] * 2
    loaded = sorted(s["kv_stores"][0]["hits"] for s in stats.values())
    assert loaded == [0, (len(PROMPT) - 1) // 16]
    reference = LLM(**{**ENGINE, "enable_prefix_caching": False}).generate(
        {"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=6, temperature=0.0))
    assert first["choices"][0]["text"] == second["choices"][0]["text"] \
        == reference[0].outputs[0].text


def test_the_router_sees_the_shared_store(cluster, redis_server):
    """Pools emptied by a reset, Redis still holding the prefix: the prefix-aware router routes
    the request as a store hit (it asked Redis), and the replica loads every block from there."""
    full_blocks = (len(PROMPT) - 1) // 16
    with store_service(redis_server.url, "prefix-aware", "store-pa") as (front, live, store):
        first = ask(live)
        wait_until(lambda: store.usage()[0] >= full_blocks)
        assert httpx.post(live.base_url + "/reset_prefix_cache", timeout=60).status_code == 200
        wait_until(lambda: sum(routing(front)["held"].values()) == 0)
        before = routing(front)["reasons"].get("store_hit", 0)
        second = ask(live)
        # the router reports its counts as it polls the hub: wait for the report that has both requests
        wait_until(lambda: sum(routing(front)["routed"].values()) == 2)
        after = routing(front)["reasons"].get("store_hit", 0)
    assert cached(first) == 0 and cached(second) == full_blocks * 16
    assert after == before + 1
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
