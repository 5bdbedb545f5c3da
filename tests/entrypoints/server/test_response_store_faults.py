"""A response store that fails or is slow costs /v1/responses nothing but the storing.

A real redis-server is stopped mid-test: the responses made meanwhile (answered and streamed)
are the ones the model made before the outage, word for word (greedy, same input: the answer
stored while Redis was up is the oracle), say `"store": false`, and are counted in /metrics; the
server keeps serving, stores again once Redis is back, and a response it could not store is
unknown to previous_response_id (404 in OpenAI's shape). A store whose write blocks never blocks
the event loop: /health answers while the write waits. A response over the tenant's byte bound
is not stored either, and says so, without counting as a fault."""
from __future__ import annotations

import logging
import threading

import httpx
import openai
import pytest
from live_server import ENGINE, MODEL, LiveServer, metrics

from prefixserve import EngineConfig, LLMEngine
from prefixserve.entrypoints.server.app import build_app
from prefixserve.entrypoints.server.config import ServerConfig
from prefixserve.entrypoints.server.response_store import MemoryBackend, ResponseStore, StoreBounds

ERRORS = "prefixserve:response_store_write_errors_total"
ASK = dict(model=MODEL, input="Name three rivers.", max_output_tokens=12, temperature=0.0)


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
        assert text_of(kept) and metrics(http)[ERRORS] == 0

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
        assert metrics(http)[ERRORS] == 2
        assert http.get("/health").status_code == 200

        redis_server.start()   # the same port, empty
        again = client.responses.create(**ASK)
        assert again.store and client.responses.retrieve(again.id).id == again.id
        with pytest.raises(openai.NotFoundError) as refused:
            client.responses.create(**ASK, previous_response_id=answered.id)
        assert refused.value.body == {"message": refused.value.body["message"], "type": "not_found_error",
                                      "param": "previous_response_id", "code": "previous_response_not_found"}
        assert metrics(http)[ERRORS] == 2


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
    errors = metrics(http)[ERRORS]
    with caplog.at_level(logging.WARNING, logger="prefixserve.entrypoints.server.responses.turn"):
        answered = client.responses.create(**ASK)
    assert answered.store is False and text_of(answered)
    assert metrics(http)[ERRORS] == errors + 1
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
    errors = metrics(http)[ERRORS]
    state.responses = ResponseStore(MemoryBackend(), StoreBounds(ttl_s=60.0, max_responses=10, max_bytes=100))
    try:
        answered = client.responses.create(**ASK)
    finally:
        state.responses = before
    assert answered.store is False and text_of(answered)
    assert metrics(http)[ERRORS] == errors
