"""The replicated service on a local Ray cluster: 2 replicas of random:qwen3-tiny behind the
prefix-aware router (and a round-robin application beside it), served over HTTP by the same
app as the single-process server. One Ray cluster for the whole module, shut down after."""
import asyncio

import httpx
import pytest
import ray   # the `replicas` extra, which the `test` extra includes

from prefixserve.engine import EngineConfig
from prefixserve.entrypoints.server.app import build_app
from prefixserve.entrypoints.server.config import ServerConfig
from prefixserve.replicas.metrics import install_routing_metrics
from prefixserve.replicas.policy import RoutingConfig
from prefixserve.replicas.service import ReplicaConfig, ReplicaService
from live_server import LiveServer
from replica_service import ENGINE, cached, router_views, routers_caught_up, routing, steady_routing
from waiting import wait_until

pytestmark = pytest.mark.slow
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron".split()


def system_prompt(tenant: int) -> str:
    return " ".join(WORDS[(tenant * 7 + i * 3) % len(WORDS)] + str(i % 10) for i in range(120))


def start(app_name: str, router: str):
    service = ReplicaService(EngineConfig(**ENGINE), ReplicaConfig(
        num_replicas=2, replica_cpus=0.5, app_name=app_name, health_check_period_s=1.0,
        routing=RoutingConfig(router=router)), max_waiting=64)
    front = service.start()
    app = build_app(front, ServerConfig(max_waiting=64))
    install_routing_metrics(app, front)
    live = LiveServer(app)
    return service, front, live


@pytest.fixture(scope="module")
def prefix_aware(cluster):
    service, front, live = start("pa", "prefix-aware")
    with live:
        yield service, front, live
    service.stop()


@pytest.fixture(scope="module")
def round_robin(cluster):
    service, front, live = start("rr", "round-robin")
    with live:
        yield service, front, live
    service.stop()


def complete(live, prompt: str, salt=None, max_tokens=2) -> dict:
    body = {"model": "random:qwen3-tiny", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(live.base_url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def replica_stats(live) -> dict:
    return live.async_llm.replica_stats()


def test_requests_sharing_a_prefix_go_to_the_replica_that_holds_it(prefix_aware):
    _, front, live = prefix_aware
    assert httpx.post(live.base_url + "/reset_prefix_cache", timeout=60).status_code == 200
    wait_until(lambda: sum(routing(front)["held"].values()) == 0)
    # The routers' counts are cumulative over the module's service: count from a settled report,
    # not from zero, so the test neither depends on running first nor on earlier reports' timing.
    total_before = sum(steady_routing(front)["routed"].values())
    first = complete(live, system_prompt(1) + " first question", salt="holder")
    wait_until(lambda: sum(routing(front)["held"].values()) > 0)
    holder = max(routing(front)["held"].items(), key=lambda kv: kv[1])[0]
    wait_until(lambda: sum(routing(front)["routed"].values()) == total_before + 1)
    routed_before = routing(front)["routed"].get(holder, 0)
    answers = [complete(live, system_prompt(1) + f" question {i}", salt="holder") for i in range(4)]
    prefix_tokens = first["usage"]["prompt_tokens"] // 16 * 16 - 16
    for a in answers:
        assert cached(a) >= prefix_tokens   # each one hit the whole shared prefix
    # The routers report their counts every poll: wait for the report, not for the routing.
    wait_until(lambda: sum(routing(front)["routed"].values()) == total_before + 5)
    assert routing(front)["routed"].get(holder, 0) - routed_before == 4


def test_prefix_aware_beats_round_robin_on_hit_rate(prefix_aware, round_robin):
    rates = {}
    for name, (_, front, live) in (("pa", prefix_aware), ("rr", round_robin)):
        hits = total = 0
        # Each tenant twice in a row first: round-robin cannot keep a tenant on one replica.
        for i, tenant in enumerate([0, 0, 1, 1, 2, 2, 3, 3, 0, 1, 2, 3]):
            r = complete(live, system_prompt(tenant) + f" q{i}", salt=f"{name}-t{tenant}")
            hits += cached(r)
            total += r["usage"]["prompt_tokens"]
            wait_until(lambda: routers_caught_up(front), what="the routers' view of the replicas' events")
        rates[name] = hits / total
    # Round-robin over 2 replicas computes each tenant's prompt on both; prefix-aware on one.
    assert rates["pa"] > rates["rr"] * 1.2, rates


def test_salts_never_share_across_replicas_or_within_one(prefix_aware):
    _, front, live = prefix_aware
    prompt = system_prompt(2) + " same words"
    complete(live, prompt, salt="tenant-a")
    wait_until(lambda: routers_caught_up(front), what="the routers' view of the replicas' events")
    assert cached(complete(live, prompt, salt="tenant-b")) == 0
    assert cached(complete(live, prompt)) == 0
    assert cached(complete(live, prompt, salt="tenant-a")) > 0


def test_reset_clears_the_routers_view(prefix_aware):
    _, front, live = prefix_aware
    complete(live, system_prompt(3) + " before reset", salt="reset")
    wait_until(lambda: sum(routing(front)["held"].values()) > 0)
    r = httpx.post(live.base_url + "/reset_prefix_cache", timeout=60)
    assert r.status_code == 200 and r.json()["dropped_blocks"] > 0
    wait_until(lambda: sum(routing(front)["held"].values()) == 0)
    assert cached(complete(live, system_prompt(3) + " after reset", salt="reset")) == 0


def test_metrics_show_routing_next_to_the_engines(prefix_aware):
    """Decisions by reason and per-replica figures agree with the routers' own counts and the
    replicas' own stats (refreshed every half second)."""
    from prometheus_client.parser import text_string_to_metric_families
    _, front, live = prefix_aware

    def settled() -> bool:
        """The routers have applied every event and the front's copy (what /metrics shows) is
        their current report."""
        return routers_caught_up(front) and front.last_routing() == router_views(front)

    routed = sum(steady_routing(front)["routed"].values())
    complete(live, system_prompt(5) + " one", salt="metrics")
    wait_until(lambda: routers_caught_up(front), what="the routers' view of the replicas' events")
    complete(live, system_prompt(5) + " two", salt="metrics")
    wait_until(lambda: settled() and sum(routing(front)["routed"].values()) == routed + 2,
               what="the routers' report of both requests, in the front's copy")
    scraped: dict = {}

    def scrape_while_still() -> bool:
        """A scrape taken between two equal, settled reports: a router may count a decision at
        any moment (Ray Serve calls choose_replicas again on a retry), so a scrape that raced
        one is taken again rather than compared with a later report."""
        before, stats_before = routing(front), replica_stats(live)
        if not settled():
            return False
        samples = {}
        for family in text_string_to_metric_families(httpx.get(live.base_url + "/metrics", timeout=60).text):
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        if not settled() or routing(front) != before or replica_stats(live) != stats_before:
            return False
        scraped.update(samples=samples, view=before, stats=stats_before)
        return True

    wait_until(scrape_while_still, what="a /metrics scrape while the routers' reports stand still")
    samples, view, stats = scraped["samples"], scraped["view"], scraped["stats"]
    assert samples[("prefixserve:router_decisions_total", (("reason", "prefix_hit"),))] \
        == view["reasons"]["prefix_hit"] >= 1
    assert len(stats) == 2
    for replica, st in stats.items():
        rate = samples[("prefixserve:replica_prefix_cache_hit_rate", (("replica", replica),))]
        assert rate == pytest.approx(st["cached_prompt_tokens"] / max(1, st["prompt_tokens"]))


def test_chat_and_anthropic_messages_are_served_and_routed_to_the_holder(prefix_aware):
    """Both chat APIs through the replicas: a second request on the same system prompt reads
    it from the cache of the replica the first one filled."""
    _, front, live = prefix_aware
    system = system_prompt(6)
    chat = {"model": "random:qwen3-tiny", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "a"}]}
    r = httpx.post(live.base_url + "/v1/chat/completions", json=chat, timeout=120)
    assert r.status_code == 200, r.text
    wait_until(lambda: routers_caught_up(front), what="the routers' view of the replicas' events")
    chat["messages"][1]["content"] = "b"
    r = httpx.post(live.base_url + "/v1/chat/completions", json=chat, timeout=120)
    assert r.status_code == 200 and cached(r.json()) > 0, r.text
    msg = {"model": "random:qwen3-tiny", "max_tokens": 2, "system": system,
           "messages": [{"role": "user", "content": "c"}]}
    first = httpx.post(live.base_url + "/v1/messages", json=msg, timeout=120)
    assert first.status_code == 200, first.text
    wait_until(lambda: routers_caught_up(front), what="the routers' view of the replicas' events")
    msg["messages"][0]["content"] = "d"
    second = httpx.post(live.base_url + "/v1/messages", json=msg, timeout=120).json()
    assert second["type"] == "message" and second["usage"]["cache_read_input_tokens"] > 0


def pinned(live) -> dict[str, int]:
    """Blocks each replica's pins hold, as it last published."""
    return {replica: s["blocks_pinned"] for replica, s in replica_stats(live).items()}


def test_a_prompt_cache_key_routes_by_the_key_first(prefix_aware):
    """Chat requests with OpenAI's prompt_cache_key and nothing else in common (their prompts
    share no block) all go to the key's home, decided by the key (reason cache_key)."""
    _, front, live = prefix_aware

    def settled() -> bool:
        """Every request routed so far has finished and both sides have reported it."""
        finished = sum(st["requests_finished"] for st in front.replica_stats().values())
        return routers_caught_up(front) and sum(routing(front)["routed"].values()) == finished

    wait_until(settled, what="the reports of the earlier requests")
    before = steady_routing(front)
    for i in range(4):
        body = {"model": "random:qwen3-tiny", "max_tokens": 1, "prompt_cache_key": "agent-7",
                "messages": [{"role": "user", "content": system_prompt(20 + i)}]}
        r = httpx.post(live.base_url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text

    def moved() -> dict:
        now = routing(front)
        assert now["reasons"].get("cache_key", 0) - before["reasons"].get("cache_key", 0) <= 4
        return {r: now["routed"].get(r, 0) - before["routed"].get(r, 0) for r in now["routed"]}

    # a router counts a decision when it makes it and the request as routed just after
    wait_until(lambda: sum(moved().values()) == 4, what="the routers' report")
    assert sorted(moved().values())[-1] == 4, moved()


def chat_with(live, content: str, question: str, salt=None) -> dict:
    body = {"model": "random:qwen3-tiny", "max_tokens": 2, "temperature": 0,
            "cached_content": content, "messages": [{"role": "user", "content": question}]}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(live.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_named_cached_contents_live_on_the_replica_the_router_picked(prefix_aware):
    """Created through the front on the replica the router picks for its tokens; requests
    naming it go there and read it from the cache; get, list and delete reach it; names and
    visibility are per namespace, as on one engine."""
    _, front, live = prefix_aware
    assert httpx.post(live.base_url + "/reset_prefix_cache", timeout=60).status_code == 200
    wait_until(lambda: sum(pinned(live).values()) == 0 and len(pinned(live)) == 2,
               what="the replicas' stats after the reset")
    content = {"model": "random:qwen3-tiny", "name": "shared-system", "system": system_prompt(7),
               "ttl": "1h", "messages": [{"role": "user", "content": "remember this"}]}
    url = live.base_url + "/v1/cached_contents"
    r = httpx.post(url, json=content, timeout=120)
    assert r.status_code == 200, r.text
    made = r.json()
    held = made["usage"]["cached_tokens"]
    assert held == made["usage"]["total_tokens"] // 16 * 16 > 0
    wait_until(lambda: sorted(pinned(live).values()) == [0, held // 16],
               what="the content's pin in one replica's stats")
    holder = next(r for r, n in pinned(live).items() if n)
    wait_until(lambda: routing(front)["held"].get(holder, 0) >= held // 16,
               what="the routers' view of the content's blocks")
    baseline = steady_routing(front)
    routed_before, total_before = baseline["routed"].get(holder, 0), sum(baseline["routed"].values())
    for q in ("first question", "second question", "third question"):
        assert cached(chat_with(live, "shared-system", q)) >= held
    wait_until(lambda: sum(routing(front)["routed"].values()) == total_before + 3,
               what="the routers' report of the three requests")
    assert routing(front)["routed"].get(holder, 0) - routed_before == 3
    # Get, list, a taken name, another namespace, delete: as on one engine.
    got = httpx.get(f"{url}/shared-system", timeout=120)
    assert got.status_code == 200 and got.json()["id"] == made["id"], got.text
    assert got.json()["usage"]["cached_tokens"] == held
    listed = httpx.get(url, timeout=120).json()["data"]
    assert [c["id"] for c in listed] == [made["id"]]
    again = httpx.post(url, json=content, timeout=120)
    assert again.status_code == 409 and again.json()["error"]["param"] == "name", again.text
    assert httpx.get(f"{url}/shared-system", params={"cache_salt": "other"}, timeout=120).status_code == 404
    other = httpx.post(url, json={**content, "name": None, "cache_salt": "other"}, timeout=120)
    assert other.status_code == 200, other.text
    assert httpx.get(f"{url}/{other.json()['id']}", timeout=120).status_code == 404
    assert [c["id"] for c in httpx.get(url, params={"cache_salt": "other"}, timeout=120).json()["data"]] \
        == [other.json()["id"]]
    assert cached(chat_with(live, other.json()["id"], "salted", salt="other")) >= held
    for key, params in (("shared-system", {}), (other.json()["id"], {"cache_salt": "other"})):
        d = httpx.delete(f"{url}/{key}", params=params, timeout=120)
        assert d.status_code == 200 and d.json()["deleted"], d.text
    assert httpx.get(f"{url}/shared-system", timeout=120).status_code == 404
    assert httpx.get(url, timeout=120).json()["data"] == []
    wait_until(lambda: sum(pinned(live).values()) == 0, what="the pins released on the replicas")


def test_a_replica_killed_mid_run(prefix_aware):
    """Kill the replica serving a request while it streams: that request ends with a clear
    EngineError, the service keeps answering (over HTTP too), Ray Serve starts a replacement,
    and the router forgets the dead replica's blocks."""
    from prefixserve.errors import EngineError
    from prefixserve.sampling_params import SamplingParams
    service, front, live = prefix_aware
    tokens = front.tokenizer.encode(system_prompt(4))

    async def run_and_kill() -> str:
        stream = await front.add_request("doomed", {"prompt_token_ids": tokens},
                                         SamplingParams(max_tokens=3000, temperature=0.0,
                                                        ignore_eos=True), cache_salt="kill")
        await stream.__anext__()
        actor = ray.get_actor(f"SERVE_REPLICA::{service.config.app_name}#EngineReplica#"
                              f"{stream.replica}", namespace="serve")
        ray.kill(actor, no_restart=True)
        with pytest.raises(EngineError, match="stopped"):
            async for out in stream:
                assert not out.finished, "the request finished before its replica was killed"
        return stream.replica

    victim = asyncio.run(run_and_kill())
    for i in range(3):
        assert complete(live, system_prompt(4) + f" after {i}", salt="kill")["choices"]
    wait_until(lambda: victim not in routing(front)["held"])
    # Ray Serve starts a replacement (a new actor loading the model): minutes on a loaded machine
    wait_until(lambda: len(replica_stats(live)) == 2 and victim not in replica_stats(live), timeout=300)


def test_a_cached_content_outlives_its_replica(prefix_aware):
    """Its replica killed, the content is created again from the front's definition on the
    replica the router picks now, and requests naming it hit it there."""
    service, front, live = prefix_aware
    url = live.base_url + "/v1/cached_contents"
    r = httpx.post(url, json={"model": "random:qwen3-tiny", "name": "survivor", "ttl": "1h",
                              "system": system_prompt(8), "messages": []}, timeout=120)
    assert r.status_code == 200, r.text
    held = r.json()["usage"]["cached_tokens"]
    wait_until(lambda: sum(pinned(live).values()) == held // 16, what="the content's pin")
    victim = next(r for r, n in pinned(live).items() if n)
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{service.config.app_name}#EngineReplica#{victim}",
                           namespace="serve"), no_restart=True)
    wait_until(lambda: len(replica_stats(live)) == 2 and victim not in replica_stats(live),
               timeout=300, what="a replacement replica")
    assert cached(chat_with(live, "survivor", "still there?")) >= held
    got = httpx.get(f"{url}/survivor", timeout=120)
    assert got.status_code == 200 and got.json()["id"] == r.json()["id"], got.text
    wait_until(lambda: sum(pinned(live).values()) == held // 16, what="the content pinned again")
    assert victim not in pinned(live)
    assert httpx.delete(f"{url}/survivor", timeout=120).status_code == 200
