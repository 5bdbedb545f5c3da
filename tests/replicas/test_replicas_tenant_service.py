"""Per-tenant metrics under replicas: 2 replicas behind the round-robin router, so each tenant's
requests land on both, and /metrics counts what every replica served it (the front sums them)."""
import json
import re

import httpx
import pytest

from prefixserve.engine import EngineConfig
from prefixserve.entrypoints.server.app import build_app
from prefixserve.entrypoints.server.auth import KeyTable
from prefixserve.entrypoints.server.config import ServerConfig
from prefixserve.replicas.policy import RoutingConfig
from prefixserve.replicas.service import ReplicaConfig, ReplicaService
from live_server import LiveServer
from replica_service import ENGINE
from waiting import wait_until

pytestmark = pytest.mark.slow
KEYS = {"k-alpha-000001": "alpha", "k-beta-0000002": "beta", "k-admin-00003": {"tenant": "ops", "admin": True}}


@pytest.fixture(scope="module")
def live(cluster, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    keys.chmod(0o600)
    service = ReplicaService(EngineConfig(**ENGINE, tenant_weights={"alpha": 1.0, "beta": 1.0, "ops": 1.0}),
                             ReplicaConfig(num_replicas=2, replica_cpus=0.5, app_name="tenants",
                                           health_check_period_s=1.0, routing=RoutingConfig(router="round-robin")),
                             max_waiting=64)
    front = service.start()
    server = LiveServer(build_app(front, ServerConfig(max_waiting=64, keys=KeyTable.from_file(keys))))
    with server:
        yield front, server
    service.stop()


def _counter(text: str, name: str, tenant: str) -> float:
    found = re.search(rf'^prefixserve:{name}\{{[^}}]*tenant="{tenant}"[^}}]*\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else -1.0


def test_tenant_metrics_count_every_replicas_requests(live):
    front, server = live
    sent = {"alpha": 0, "beta": 0}
    key_of = {"alpha": "k-alpha-000001", "beta": "k-beta-0000002"}
    # two in a row per tenant: round-robin over 2 replicas sends each tenant to both
    for i, tenant in enumerate(["alpha", "alpha", "beta", "beta"] * 3):
        key = key_of[tenant]
        r = httpx.post(server.base_url + "/v1/completions", timeout=120, headers={"Authorization": f"Bearer {key}"},
                       json={"model": "random:qwen3-tiny", "prompt": f"{tenant} request {i} " * (4 + i),
                             "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        sent[tenant] += r.json()["usage"]["prompt_tokens"]

    def served_by_both() -> bool:
        per_replica = list(front.replica_stats().values())
        return len(per_replica) == 2 and all(
            sum(t["prompt_tokens"] for t in s["tenants"] if t["tenant"] == "alpha") > 0 for s in per_replica)

    wait_until(served_by_both, what="alpha's requests in both replicas' published stats")

    def metrics() -> str:
        return httpx.get(server.base_url + "/metrics", headers={"Authorization": "Bearer k-admin-00003"},
                         timeout=60).text

    wait_until(lambda: all(_counter(metrics(), "tenant_prefix_cache_queries_total", t) == sent[t] for t in sent),
               what="each tenant's prompt tokens, summed over the replicas, in /metrics")
