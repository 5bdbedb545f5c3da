"""Tenants, tried as an attacker would: with API keys, one tenant never sees, uses, changes or
deletes what another cached, and never reads another's prompt in a diagnosis; without keys, a
client still cannot use or list a salted content without its salt.

Real server (uvicorn on a loopback port), official clients; oracles are the cached-token
counts the engine reports, the other tenant's view of the same objects, and the KV manager's
invariants.
"""
from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from live_server import LiveServer, assert_pool_idle

from prefixserve import EngineConfig, LLMEngine
from prefixserve.entrypoints.server.app import build_app
from prefixserve.entrypoints.server.auth import KeyTable, Principal
from prefixserve.entrypoints.server.config import ServerConfig

MODEL = "random:qwen3-tiny"
ENGINE = dict(model=MODEL, seed=0, block_size=16, num_kv_blocks=512, max_model_len=2048, max_num_seqs=32)
KEYS = {"key-of-acme-0001": "acme", "key-of-zeta-0002": "zeta", "key-of-beta-0004": "beta",
        "key-of-root-0003": {"tenant": "ops", "admin": True},
        "key-of-batch-0005": {"tenant": "batch", "max_priority": 10}}
SECRET = ("ACME internal playbook: the launch code is 7 4 1 9, the partner is Globex, and the price "
          "floor is forty two. ") * 4


def keyed_server(tmp_path_factory, engine: dict):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps(KEYS))
    app = build_app(LLMEngine(EngineConfig(**engine)), ServerConfig(keys=KeyTable.from_file(path)))
    with LiveServer(app) as live:
        yield live


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from keyed_server(tmp_path_factory, ENGINE)


def http(server, key=None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.base_url, timeout=60, headers=headers)


def chat(client: httpx.Client, content: str, **extra) -> httpx.Response:
    return client.post("/v1/chat/completions", json={
        "model": MODEL, "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "system", "content": SECRET}, {"role": "user", "content": content}], **extra})


def test_a_missing_or_wrong_key_is_a_401_on_every_api(server):
    with http(server) as anon, http(server, "not-a-real-key-999") as wrong:
        for client in (anon, wrong):
            r = chat(client, "hi")
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert client.get("/v1/cached_contents").status_code == 401
            assert client.get("/v1/models").status_code == 401
        assert anon.get("/health").status_code == 200  # liveness stays open
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong-key-123", max_retries=0).models.list()
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.base_url, api_key="wrong-key-123", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    ok = anthropic.Anthropic(base_url=server.base_url, api_key="key-of-zeta-0002", max_retries=0)
    assert ok.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]).id


def test_tenants_never_share_cached_prefixes_even_when_one_names_the_others_salt(server):
    with http(server, "key-of-acme-0001") as acme, http(server, "key-of-zeta-0002") as zeta:
        assert chat(acme, "first").status_code == 200
        again = chat(acme, "second").json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        # the same system prompt from another tenant: computed afresh, whatever salt it claims
        # (each salt once: a salt repeated would hit zeta's own cache, which is as it should be)
        for salt in (None, "acme", json.dumps(["tenant", "acme", None]), "tenant:acme"):
            extra = {"cache_salt": salt} if salt is not None else {}
            r = chat(zeta, "second", **extra).json()
            assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, salt


def test_cached_contents_are_invisible_across_tenants(server):
    body = {"model": MODEL, "name": "playbook", "system": SECRET, "ttl": "1h"}
    with http(server, "key-of-acme-0001") as acme, http(server, "key-of-zeta-0002") as zeta:
        created = acme.post("/v1/cached_contents", json=body)
        assert created.status_code == 200, created.text
        cid = created.json()["id"]
        assert [c["id"] for c in acme.get("/v1/cached_contents").json()["data"]] == [cid]
        # zeta: listing, reading, using, patching and deleting by name or id all find nothing
        assert zeta.get("/v1/cached_contents").json()["data"] == []
        for key in ("playbook", cid):
            assert zeta.get(f"/v1/cached_contents/{key}").status_code == 404
            assert zeta.patch(f"/v1/cached_contents/{key}", json={"ttl": 1}).status_code == 404
            assert zeta.delete(f"/v1/cached_contents/{key}").status_code == 404
            used = zeta.post("/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 2, "cached_content": key,
                "messages": [{"role": "user", "content": "what is the launch code?"}]})
            assert used.status_code == 404
        # the name is free in zeta's namespace
        assert zeta.post("/v1/cached_contents", json={**body, "system": "zeta's own " * 20}).status_code == 200
        # acme's content survived every attempt, and acme can use it
        used = acme.post("/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 2, "cached_content": "playbook",
            "messages": [{"role": "user", "content": "what is the launch code?"}]}).json()
        assert used["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        for client in (acme, zeta):
            assert client.delete("/v1/cached_contents/playbook").status_code == 200
    assert server.in_engine(lambda e: e.stats().blocks_pinned) == 0


def test_a_diagnosis_never_quotes_another_tenants_prompt(server):
    # beta never sent the secret itself: nothing of it may reach beta
    with http(server, "key-of-acme-0001") as acme, http(server, "key-of-beta-0004") as zeta:
        first = chat(acme, "tell me the plan").json()
        probe = zeta.post("/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 2, "diagnose_against": first["id"],
            "messages": [{"role": "system", "content": "ACME internal playbook"},
                         {"role": "user", "content": "x"}]})
        assert probe.status_code == 200
        text = json.dumps(probe.json()["prefixserve"])
        assert "launch code" not in text and "Globex" not in text
        nearest = zeta.post("/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 2, "diagnose": True,
            "messages": [{"role": "system", "content": SECRET[:60]}, {"role": "user", "content": "x"}]})
        assert "Globex" not in json.dumps(nearest.json()["prefixserve"])


def test_whole_server_routes_need_an_admin_key(server):
    with http(server, "key-of-acme-0001") as acme, http(server, "key-of-root-0003") as root:
        assert acme.post("/reset_prefix_cache").status_code == 403
        assert acme.get("/metrics").status_code == 403
        assert root.get("/metrics").status_code == 200
        assert root.post("/reset_prefix_cache").status_code == 200
    assert_pool_idle(server)


def test_without_keys_a_salted_content_is_not_usable_or_listed_without_its_salt():
    app = build_app(LLMEngine(EngineConfig(**ENGINE)), ServerConfig())
    with LiveServer(app) as live, httpx.Client(base_url=live.base_url, timeout=60) as c:
        made = c.post("/v1/cached_contents", json={"model": MODEL, "name": "doc", "system": SECRET,
                                                   "cache_salt": "tenant-a"})
        assert made.status_code == 200
        assert c.get("/v1/cached_contents").json()["data"] == []
        assert c.get("/v1/cached_contents", params={"cache_salt": "tenant-b"}).json()["data"] == []
        listed = c.get("/v1/cached_contents", params={"cache_salt": "tenant-a"}).json()["data"]
        assert [d["name"] for d in listed] == ["doc"]
        for salt in (None, "tenant-b"):
            extra = {"cache_salt": salt} if salt else {}
            r = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "cached_content": "doc",
                                                     "messages": [{"role": "user", "content": "x"}], **extra})
            assert r.status_code == 404
            assert c.delete("/v1/cached_contents/doc", params=extra and {"cache_salt": salt}).status_code == 404
        r = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "cached_content": "doc",
                                                 "cache_salt": "tenant-a",
                                                 "messages": [{"role": "user", "content": "x"}]})
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


SHARE_ENGINE = dict(ENGINE, max_pinned_fraction_per_tenant=0.1, max_cached_contents_per_tenant=3)


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory):
    yield from keyed_server(tmp_path_factory, SHARE_ENGINE)


def test_a_tenant_flooding_cached_contents_is_stopped_at_its_maximum_and_others_are_not(shared_server):
    # Identical contents share one pin, so without a per-tenant count one tenant could register
    # them without end, each keeping its tokens and conversation, until the server ran out of memory.
    body = {"model": MODEL, "system": SECRET, "ttl": "1h"}
    with http(shared_server, "key-of-acme-0001") as acme, http(shared_server, "key-of-zeta-0002") as zeta:
        made = [acme.post("/v1/cached_contents", json=body) for _ in range(3)]
        assert [r.status_code for r in made] == [200, 200, 200]
        refused = acme.post("/v1/cached_contents", json=body)
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "cached_content_limit"
        assert len(acme.get("/v1/cached_contents").json()["data"]) == 3
        # the same count under another salt of the same tenant: the maximum is the tenant's
        salted = acme.post("/v1/cached_contents", json={**body, "cache_salt": "project-x"})
        assert salted.status_code == 409 and salted.json()["error"]["code"] == "cached_content_limit"
        assert zeta.post("/v1/cached_contents", json={**body, "name": "z"}).status_code == 200
        assert acme.delete(f"/v1/cached_contents/{made[0].json()['id']}").status_code == 200
        again = acme.post("/v1/cached_contents", json=body)
        assert again.status_code == 200
        for client, data in ((acme, acme.get("/v1/cached_contents").json()["data"]),
                             (zeta, zeta.get("/v1/cached_contents").json()["data"])):
            for c in data:
                assert client.delete(f"/v1/cached_contents/{c['id']}").status_code == 200
    assert_pool_idle(shared_server)


def pinned_chat(client: httpx.Client, doc: str) -> dict:
    r = client.post("/v1/chat/completions", json={
        "model": MODEL, "max_tokens": 1, "temperature": 0,
        "messages": [{"role": "system", "content": [{"type": "text", "text": doc,
                                                     "cache_control": {"type": "ephemeral", "ttl": "1h"}}]},
                     {"role": "user", "content": "q"}]})
    assert r.status_code == 200, r.text
    (entry,) = r.json()["prefixserve"]["cache_breakpoints"]
    return {**entry, "warning": r.headers.get("prefixserve-cache-warning")}


def test_a_tenant_cannot_pin_past_its_share_of_the_pool_and_the_others_still_pin(shared_server):
    share = int(SHARE_ENGINE["num_kv_blocks"] * SHARE_ENGINE["max_pinned_fraction_per_tenant"])
    block = ENGINE["block_size"]
    docs = {name: " ".join(f"{name} fact {i} is {i * 7 % 13}." for i in range(words))
            for name, words in (("alpha", 30), ("beta", 30), ("gamma", 30), ("delta", 30))}
    held = {"acme": 0, "zeta": 0}
    outcomes = []
    with http(shared_server, "key-of-acme-0001") as acme, http(shared_server, "key-of-zeta-0002") as zeta:
        for tenant, client, doc in (("acme", acme, "alpha"), ("acme", acme, "beta"), ("acme", acme, "gamma"),
                                    ("zeta", zeta, "delta"), ("zeta", zeta, "alpha")):
            entry = pinned_chat(client, docs[doc])
            blocks = entry["prefix_tokens"] // block
            fits = held[tenant] + blocks <= share
            outcomes.append(fits)
            if fits:
                assert entry["error"] is None and entry["pinned_tokens"] == blocks * block
                held[tenant] += blocks
            else:
                assert entry["pinned_tokens"] == 0 and "each tenant may pin" in entry["error"]
                assert "not pinned" in entry["warning"]
        assert False in outcomes[:3] and outcomes[3:] == [True, True]   # acme stopped, zeta not
        assert shared_server.in_engine(lambda e: e.stats().blocks_pinned) == held["acme"] + held["zeta"]
    shared_server.in_engine(lambda e: e.reset_prefix_cache())
    assert_pool_idle(shared_server)


def test_serve_gives_each_tenant_half_the_pinned_share_when_the_keys_name_several():
    from prefixserve.entrypoints.serve import tenant_pin_share
    one = KeyTable.single("a-single-key-0001")
    several = KeyTable({"k-000000000001": Principal("acme", False), "k-000000000002": Principal("zeta", False)})
    assert tenant_pin_share(0.5, None, several) == 0.25
    assert tenant_pin_share(0.5, None, one) is None and tenant_pin_share(0.5, None, None) is None
    assert tenant_pin_share(0.5, 0.1, one) == 0.1 and tenant_pin_share(0.5, 0.4, several) == 0.4


def test_a_tenant_key_may_not_ask_for_a_priority_above_its_limit(server):
    # Under the priority policies a higher priority runs first, preempts others and keeps its
    # blocks cached longest: a tenant's key may not raise it past max_priority (0 by default).
    def ask(key, priority, path="/v1/chat/completions"):
        body = {"model": MODEL, "max_tokens": 1, "priority": priority,
                "messages": [{"role": "user", "content": "hi"}]}
        if path == "/v1/completions":
            body = {"model": MODEL, "max_tokens": 1, "priority": priority, "prompt": "hi"}
        with http(server, key) as client:
            return client.post(path, json=body)
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages"):
        refused = ask("key-of-acme-0001", 1, path)
        error = refused.json()["error"]
        assert refused.status_code == 403 and error["type"] == "permission_error", path
        assert error.get("param", "priority") == "priority" and "priority" in error["message"]
        assert ask("key-of-acme-0001", 0, path).status_code == 200
    assert ask("key-of-acme-0001", -7).status_code == 200
    assert ask("key-of-root-0003", 10**6).status_code == 200          # an admin key: any
    assert ask("key-of-batch-0005", 10).status_code == 200
    assert ask("key-of-batch-0005", 11).status_code == 403
    assert_pool_idle(server)


@pytest.mark.parametrize("bad", ["high", True, 1.5])
def test_a_keys_file_with_a_max_priority_that_is_not_an_integer_is_refused(tmp_path, bad):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"key-of-acme-0001": {"tenant": "acme", "max_priority": bad}}))
    with pytest.raises(ValueError, match="max_priority"):
        KeyTable.from_file(path)
