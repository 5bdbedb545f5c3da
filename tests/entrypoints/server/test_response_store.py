"""The stored responses of /v1/responses (response_store.py) in each place they can live (this
process, a folder, a real redis-server): each tenant bounded in responses and bytes on its own,
expiry, tenants unable to reach each other's ids, ids that are not ours never reaching a path or
a key, and a second store on the same folder or Redis (a restarted server, a replica) seeing
what the first stored."""
from __future__ import annotations

import json
import uuid

import pytest

from prefixserve.entrypoints.server.response_store import ResponseStore, StoreBounds


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def rid() -> str:
    return f"resp_{uuid.uuid4().hex}"


def record(size: int = 100) -> dict:
    return {"id": rid(), "history": [{"text": "x" * size}]}


def _url(kind: str, request, tmp_path) -> str:
    if kind == "mem":
        return "mem://"
    if kind == "file":
        return f"file://{tmp_path}/responses"
    return request.getfixturevalue("redis_server").url


@pytest.fixture(params=["mem", "file", "redis"])
def url(request, tmp_path):
    return _url(request.param, request, tmp_path)


@pytest.fixture(params=["file", "redis"])
def shared_url(request, tmp_path):
    """The places a restarted server or another replica reads."""
    return _url(request.param, request, tmp_path)


def opened(url: str, clock: Clock, **bounds) -> ResponseStore:
    store = ResponseStore.open(url, StoreBounds(**{"ttl_s": 3600.0, "max_responses": 1000,
                                                   "max_bytes": 10**6, **bounds}))
    store.clock = clock
    return store


def test_each_tenant_keeps_its_newest_responses_within_its_count(url):
    clock = Clock()
    store = opened(url, clock, max_responses=3)
    others = [record() for _ in range(2)]
    for r in others:
        store.put("globex", r)
    mine = []
    for _ in range(7):
        clock.now += 1
        mine.append(record())
        store.put("acme", mine[-1])
        assert store.usage("acme")[0] <= 3
    assert [store.get("acme", r["id"]) is not None for r in mine] == [False] * 4 + [True] * 3
    assert all(store.get("globex", r["id"]) is not None for r in others)


def test_bytes_per_tenant_stay_bounded_under_a_soak(url):
    clock = Clock()
    limit = 20_000
    store = opened(url, clock, max_bytes=limit)
    sizes = [50, 900, 3000, 7000, 120]
    for i in range(200):
        clock.now += 1
        store.put("acme", record(sizes[i % len(sizes)]))
        assert store.usage("acme")[1] <= limit
    assert store.usage("acme")[0] >= 2
    assert not store.put("acme", record(limit))  # larger than the tenant may hold: not stored
    assert store.usage("acme")[1] <= limit


def test_responses_expire(url):
    clock = Clock()
    store = opened(url, clock, ttl_s=60.0)
    old = record()
    store.put("acme", old)
    clock.now += 59
    assert store.get("acme", old["id"])["history"] == old["history"]
    clock.now += 2
    assert store.get("acme", old["id"]) is None
    store.put("acme", record())  # storing sweeps what expired
    assert store.usage("acme")[0] == 1


def test_a_tenant_never_reaches_another_tenants_ids_and_foreign_ids_are_unknown(url):
    store = opened(url, Clock())
    mine = record()
    store.put("acme", mine)
    assert store.get("globex", mine["id"]) is None and store.get(None, mine["id"]) is None
    assert not store.delete("globex", mine["id"])
    assert store.get("acme", mine["id"]) is not None
    for bad in ("../" + mine["id"], mine["id"] + "/..", "resp_" + "g" * 32, "", mine["id"].upper()):
        assert store.get("acme", bad) is None and not store.delete("acme", bad)
    assert store.delete("acme", mine["id"]) and store.get("acme", mine["id"]) is None


def test_a_second_store_on_the_same_place_sees_what_the_first_stored(shared_url):
    clock = Clock()
    first, second = opened(shared_url, clock), opened(shared_url, clock)
    r = record()
    first.put("acme", r)
    assert json.dumps(second.get("acme", r["id"])["history"]) == json.dumps(r["history"])
    assert second.delete("acme", r["id"]) and first.get("acme", r["id"]) is None


def test_a_malformed_store_url_is_refused_at_start():
    bounds = StoreBounds(60.0, 10, 10**6)
    for bad in ("s3://bucket", "file://host/dir", "memory"):
        with pytest.raises(ValueError, match="response"):
            ResponseStore.open(bad, bounds)
