"""Stored responses survive a restart: a server keeping them in a folder (file://) or in Redis
(redis://, as replicas share them) is stopped and a new one started on the same store (and on the
same KV store, so earlier turns' blocks are there to hit). previous_response_id still continues
the conversation, and its prompt is the previous turn's tokens exactly: the new server has never
seen the turn, yet the cache (which only hits identical token ids) covers every full block of the
previous prompt and output. The same conversation sent as plain items, re-tokenized from text,
does not get there: the exact tokens came from the store."""
from __future__ import annotations

import json

import openai
import pytest
from live_server import ENGINE, MODEL, LiveServer
from tool_fixtures import TOOLS

from prefixserve import EngineConfig, LLMEngine
from prefixserve.entrypoints.server.app import build_app
from prefixserve.entrypoints.server.config import ServerConfig

BS = ENGINE["block_size"]
RESPONSE_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
ASK = dict(model=MODEL, instructions="You are a travel agent; call one tool per turn.", tools=RESPONSE_TOOLS,
           tool_choice="required", parallel_tool_calls=False, max_output_tokens=200, temperature=1.0)


@pytest.fixture(params=["file", "redis"])
def stores(request, tmp_path) -> tuple[str, str]:
    """(KV store URL, response store URL)."""
    if request.param == "file":
        return f"file://{tmp_path}/kv", f"file://{tmp_path}/responses"
    url = request.getfixturevalue("redis_server").url
    return url, url


def serve(stores: tuple[str, str]) -> LiveServer:
    kv, responses = stores
    engine = EngineConfig(**ENGINE, kv_stores=[kv], kv_store_write="through")
    return LiveServer(build_app(LLMEngine(engine), ServerConfig(response_store=responses)))


def client_of(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def answer(response, turn: int) -> dict:
    (call,) = [o for o in response.output if o.type == "function_call"]
    return {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"turn": turn, "c": 21})}


def test_a_restarted_server_continues_a_stored_response_token_for_token(stores):
    with serve(stores) as live:
        client = client_of(live)
        first = client.responses.create(**ASK, input="Weather in Paris and Oslo?", extra_body={"seed": 1})
        second = client.responses.create(**ASK, previous_response_id=first.id, input=[answer(first, 1)],
                                         extra_body={"seed": 2})
    assert first.status == second.status == "completed"
    bound = (second.usage.input_tokens + second.usage.output_tokens - 1) // BS * BS

    with serve(stores) as live:
        client = client_of(live)
        kept = client.responses.retrieve(second.id)
        assert kept.output[0].model_dump() == second.output[0].model_dump()
        # the same conversation as plain items, rendered and tokenized from its text
        items = [i.model_dump(exclude_none=True)
                 for i in client.responses.input_items.list(second.id, order="asc", limit=100).data]
        items += [o.model_dump(exclude_none=True) for o in second.output] + [answer(second, 2)]
        plain = client.responses.create(**ASK, input=items, store=False, extra_body={"seed": 3})
        third = client.responses.create(**ASK, previous_response_id=second.id, input=[answer(second, 2)],
                                        extra_body={"seed": 3})
    print(f"before the restart: turn 2 prompt {second.usage.input_tokens} + output {second.usage.output_tokens} "
          f"tokens; after it: turn 3 prompt {third.usage.input_tokens}, cached "
          f"{third.usage.input_tokens_details.cached_tokens} (bound {bound}); the same items sent plainly: "
          f"prompt {plain.usage.input_tokens}, cached {plain.usage.input_tokens_details.cached_tokens}")
    assert third.usage.input_tokens_details.cached_tokens >= bound
    assert plain.usage.input_tokens_details.cached_tokens < bound
