"""`serve --request-log` with /v1/responses: each response is logged as the chat-completions body
its prompt renders from (its stored history included), which the lint's own reader and renderer
read. Oracles: the conversation the test sent, and the prompt tokens the server reported."""
from __future__ import annotations

import json

import openai
from live_server import ENGINE, MODEL, LiveServer
from tool_fixtures import TOOLS
from waiting import wait_until

from prefixserve import EngineConfig, LLMEngine
from prefixserve.diagnose import load_renderer
from prefixserve.diagnose.log_reader import read_log
from prefixserve.entrypoints.server.app import build_app
from prefixserve.entrypoints.server.config import ServerConfig

RESPONSE_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def records(path, count: int) -> list[dict]:
    """The log's records once it holds `count` (the writer thread writes after the reply). Only
    whole lines: one read can land while the writer is part way through a record."""
    lines: list[str] = []

    def written() -> bool:
        text = path.read_text() if path.exists() else ""
        lines[:] = text[:text.rfind("\n") + 1].splitlines()
        return len(lines) >= count

    wait_until(written, what=f"{count} records in the request log")
    return [json.loads(line) for line in lines]


def test_a_logged_response_reads_back_as_the_conversation_it_continued(tmp_path):
    path = tmp_path / "requests.jsonl"
    app = build_app(LLMEngine(EngineConfig(**ENGINE)), ServerConfig(request_log=str(path)))
    with LiveServer(app) as live:
        client = openai.OpenAI(base_url=live.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        ask = dict(model=MODEL, instructions="Use the tools.", tools=RESPONSE_TOOLS, tool_choice="required",
                   max_output_tokens=200, temperature=1.0, extra_body={"seed": 5})
        first = client.responses.create(**ask, input="Weather in Lima?")
        (call,) = [o for o in first.output if o.type == "function_call"]
        second = client.responses.create(**ask, previous_response_id=first.id, input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": "19 C"}])
        raw = records(path, 2)
    copy = tmp_path / "copy.jsonl"
    copy.write_text("".join(json.dumps(r) + "\n" for r in raw))
    logged = list(read_log(copy))
    assert len(logged) == 2
    opening = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "Weather in Lima?"}]
    assert logged[0].messages == opening and logged[0].tools == TOOLS
    assert logged[1].messages == opening + [
        {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function",
                                              "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "19 C"}]
    # the first prompt has no earlier turn to keep the tokens of: the lint renders it to the very
    # prompt the engine was given
    assert len(load_renderer(MODEL).render(logged[0]).token_ids) == first.usage.input_tokens
    assert second.usage.input_tokens > first.usage.input_tokens
