"""A response store that fails or is slow costs /v1/responses nothing but the storing.

A real redis-server is stopped mid-test: the responses made meanwhile (answered and streamed)
are the ones the model made before the outage, word for word (greedy, same input: the answer
stored while Redis was up is the oracle), say `"store": false`, and are counted in /metrics; the
server keeps serving, stores again once Redis is back, and a response it could not store is
unknown to previous_response_id (404 in OpenAI's shape). A store whose write blocks never blocks
the event loop: /health answers while the write waits. A response over the tenant's byte bound
is not stored either, and says so, without counting as a fault.

Reads and deletes of a stored response while the store is unreachable (Redis stopped, a file
store's I/O failing) are a 503 in OpenAI's shape with Retry-After, logged once each as a warning
and counted, while requests that read nothing are served; once the store is back (Redis
restarted on its saved data) the very same requests succeed. A record the store returns but that
does not parse is no outage: a 500, not counted."""
from __future__ import annotations

import logging
import threading
from pathlib import Path

import httpx
import openai
import pytest
import redis
from live_server import ENGINE, MODEL, LiveServer
from prometheus_client.parser import text_string_to_metric_families

from prefixserve import EngineConfig, LLMEngine
from prefixserve.entrypoints.server.app import build_app
from prefixserve.entrypoints.server.config import ServerConfig
from prefixserve.entrypoints.server.response_store import MemoryBackend, ResponseStore, StoreBounds

FAMILY = "prefixserve:response_store_errors_total"
ASK = dict(model=MODEL, input="Name three rivers.", max_output_tokens=12, temperature=0.0)
UNAVAILABLE = {"error": {"message": "the response store is unavailable; retry later", "type": "server_error",
                         "param": None, "code": "response_store_unavailable"}}
READS_LOGGER = "prefixserve.entrypoints.server.responses.store_reads"


def metrics(http: httpx.Client) -> dict[str, float]:
    """The response store's error counter by operation."""
    out = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == FAMILY:
                out[sample.labels["operation"]] = sample.value
    return out


def reads_of(rid: str) -> list[tuple[str, str, dict | None]]:
    """(method, path, JSON body) of every request that reads or deletes the stored response rid."""
    return [("POST", "/v1/responses", {**ASK, "previous_response_id": rid, "input": "And three more."}),
            ("POST", "/v1/responses", {**ASK, "previous_response_id": rid, "input": "And more.", "stream": True}),
            ("GET", f"/v1/responses/{rid}", None),
            ("GET", f"/v1/responses/{rid}/input_items", None),
            ("DELETE", f"/v1/responses/{rid}", None)]


def client_of(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def text_of(response) -> str:
    (message,) = [o for o in response.output if o.type == "message"]
    return message.content[0].text


def test_a_redis_outage_loses_no_answer_and_the_server_keeps_serving(redis_server):
    app = build_app(LLMEngine(EngineConfig(**ENGINE)), ServerConfig(response_store=redis_server.url))
    with LiveServer(app) as live, httpx.Client(base_url=live.base_url, timeout=120) as http:
        client = client_of(live)
        kept = client.responses.create(**ASK)
        assert kept.store and client.responses.retrieve(kept.id).output[0].model_dump() == kept.output[0].model_dump()
        assert text_of(kept) and metrics(http)["write"] == 0

        redis_server.kill()
        answered = client.responses.create(**ASK)
        with client.responses.stream(**ASK) as stream:
            events = list(stream)
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert events[-1].type == f"response.{kept.status}"   # a stream stopped by max_output_tokens: incomplete
        streamed = events[-1].response
        for response in (answered, streamed):
            assert response.status == kept.status and response.store is False
            assert text_of(response) == text_of(kept)
            assert response.usage.output_tokens == kept.usage.output_tokens
        assert deltas == text_of(kept)
        assert metrics(http)["write"] == 2
        assert http.get("/health").status_code == 200

        redis_server.start()   # the same port, empty
        again = client.responses.create(**ASK)
        assert again.store and client.responses.retrieve(again.id).id == again.id
        with pytest.raises(openai.NotFoundError) as refused:
            client.responses.create(**ASK, previous_response_id=answered.id)
        assert refused.value.body == {"message": refused.value.body["message"], "type": "not_found_error",
                                      "param": "previous_response_id", "code": "previous_response_not_found"}
        assert metrics(http)["write"] == 2


class GatedBackend(MemoryBackend):
    """Its writes wait until released (a store far away); `fail` makes them raise instead."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.fail = fail
        self.entered, self.release = threading.Event(), threading.Event()

    def put(self, tenant: str, rid: str, data: bytes, now: float) -> None:
        if self.fail:
            raise OSError(28, "No space left on device")
        self.entered.set()
        # held well past the test's /health timeout: an answer to it can only come while the write waits
        assert self.release.wait(300)
        super().put(tenant, rid, data, now)


@pytest.fixture()
def backend(server, request):
    """The module server's response store, on a GatedBackend for the test."""
    state = server.app.state.server
    before = state.responses
    gated = GatedBackend(fail=request.param)
    state.responses = ResponseStore(gated, before.bounds)
    yield gated
    gated.release.set()
    state.responses = before


@pytest.mark.parametrize("backend", [False], indirect=True, ids=["slow"])
def test_a_slow_store_write_does_not_block_the_event_loop(server, client, http, backend):
    answers = []
    creating = threading.Thread(target=lambda: answers.append(client.responses.create(**ASK)))
    creating.start()
    try:
        assert backend.entered.wait(60)
        # answered while the write still waits (a blocked loop could answer only after the release,
        # which comes after this call: it would time out); 60 s, as a loaded machine can be slow
        health = http.get("/health", timeout=60)
        assert health.status_code == 200 and not answers
    finally:
        backend.release.set()
        creating.join(120)
    (answered,) = answers
    assert answered.store and client.responses.retrieve(answered.id).id == answered.id


@pytest.mark.parametrize("backend", [True], indirect=True, ids=["failing"])
def test_a_failed_write_is_answered_logged_counted_and_unknown_later(server, client, http, backend, caplog):
    errors = metrics(http)["write"]
    with caplog.at_level(logging.WARNING, logger="prefixserve.entrypoints.server.responses.turn"):
        answered = client.responses.create(**ASK)
    assert answered.store is False and text_of(answered)
    assert metrics(http)["write"] == errors + 1
    assert any(answered.id in r.getMessage() and r.exc_info is not None for r in caplog.records)
    with pytest.raises(openai.NotFoundError) as refused:
        client.responses.retrieve(answered.id)
    assert refused.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError) as refused:
        client.responses.create(**ASK, previous_response_id=answered.id)
    assert refused.value.body["code"] == "previous_response_not_found"


def test_a_response_too_large_to_store_says_so_and_is_no_fault(server, client, http):
    state = server.app.state.server
    before = state.responses
    errors = metrics(http)["write"]
    state.responses = ResponseStore(MemoryBackend(), StoreBounds(ttl_s=60.0, max_responses=10, max_bytes=100))
    try:
        answered = client.responses.create(**ASK)
    finally:
        state.responses = before
    assert answered.store is False and text_of(answered)
    assert metrics(http)["write"] == errors


def assert_unavailable(http: httpx.Client, reads: list[tuple[str, str, dict | None]], retry_after: int) -> None:
    for method, path, body in reads:
        answer = http.request(method, path, json=body)
        assert (answer.status_code, answer.json()) == (503, UNAVAILABLE), (method, path)
        assert answer.headers["retry-after"] == str(retry_after)


def test_reads_in_a_redis_outage_are_a_503_to_retry_and_succeed_once_it_is_back(redis_server, caplog):
    config = ServerConfig(response_store=redis_server.url, retry_after_s=7)
    app = build_app(LLMEngine(EngineConfig(**ENGINE)), config)
    with LiveServer(app) as live, httpx.Client(base_url=live.base_url, timeout=120) as http:
        kept = client_of(live).responses.create(**ASK)
        stored = http.get(f"/v1/responses/{kept.id}").json()
        inputs = http.get(f"/v1/responses/{kept.id}/input_items", params={"order": "asc"}).json()["data"]
        with redis.Redis.from_url(redis_server.url) as saving:
            saving.save()   # the restarted redis-server loads what it held
        redis_server.kill()

        with caplog.at_level(logging.WARNING):
            assert_unavailable(http, reads_of(kept.id), retry_after=7)
        warned = [r for r in caplog.records if r.name == READS_LOGGER]
        assert len(warned) == 5 and all(r.levelno == logging.WARNING for r in warned)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert metrics(http) == {"read": 4, "delete": 1, "write": 0}
        plain = http.post("/v1/responses", json=ASK)   # reads nothing: served (its write fails)
        assert plain.status_code == 200 and plain.json()["store"] is False
        assert http.get("/health").status_code == 200
        assert metrics(http) == {"read": 4, "delete": 1, "write": 1}

        redis_server.start()   # the same port, the saved data
        answers = [http.request(method, path, json=body) for method, path, body in reads_of(kept.id)]
        assert [a.status_code for a in answers] == [200] * 5
        continued, _, got, listed, deleted = (a.json() if a.headers["content-type"].startswith("application/json")
                                              else None for a in answers)
        assert got == stored and listed["data"] == inputs[::-1]
        assert deleted == {"id": kept.id, "object": "response", "deleted": True}
        assert continued["previous_response_id"] == kept.id
        history = http.get(f"/v1/responses/{continued['id']}/input_items", params={"order": "asc"}).json()["data"]
        assert history[:len(inputs)] == inputs
        assert http.get(f"/v1/responses/{kept.id}").status_code == 404
        assert metrics(http) == {"read": 4, "delete": 1, "write": 1}


@pytest.fixture()
def file_store(server, tmp_path):
    """The module server's response store, on a file:// store in tmp_path, for the test."""
    state = server.app.state.server
    before = state.responses
    state.responses = ResponseStore.open(f"file://{tmp_path}/responses", before.bounds)
    yield tmp_path / "responses"
    state.responses = before


def test_a_file_store_failing_its_io_is_a_503_and_a_corrupt_record_a_500(server, client, http, file_store):
    kept = client.responses.create(**ASK)
    stored = http.get(f"/v1/responses/{kept.id}").json()
    counted = metrics(http)
    (folder,) = file_store.iterdir()   # the tenant's
    away = folder.rename(folder.parent / "away")
    folder.write_bytes(b"")   # where the folder was, a file: reading through it is an OSError
    assert_unavailable(http, reads_of(kept.id), retry_after=server.app.state.server.config.retry_after_s)
    assert metrics(http) == {**counted, "read": counted["read"] + 4, "delete": counted["delete"] + 1}

    folder.unlink()
    away.rename(folder)
    assert http.get(f"/v1/responses/{kept.id}").json() == stored
    counted = metrics(http)
    Path(folder, f"{kept.id}.json").write_bytes(b"{\"id\": ")   # cut short: no outage, a fault
    broken = httpx.get(f"{server.base_url}/v1/responses/{kept.id}")   # uvicorn closes a connection after a 500
    assert broken.status_code == 500 and broken.json()["error"]["code"] is None
    assert metrics(http) == counted
