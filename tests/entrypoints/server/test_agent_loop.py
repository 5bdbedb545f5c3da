"""An agent loop stays in the prefix cache turn after turn: 12 turns of forced tool calls and tool
results through the official openai and anthropic clients against a live server.

Oracle: each turn's prompt re-renders the whole previous turn (its prompt and the model's output)
first, so the engine can reuse every full block of it that was computed: cached tokens must reach
floor((previous prompt + previous output - 1) / block size) * block size (the last output token,
the end of turn, was sampled but never fed back). Nothing is copied from our own output: the
bound comes from the previous response's usage and the block size.

Where the template itself rewrites an earlier turn (the built-in one drops the reasoning of
assistant turns before the last user message, like Qwen3's), the continuity cannot hold, and
the diagnosis shows the dropped text and names the turn whose arrival rewrote it.
"""
from __future__ import annotations

import json

from live_server import ENGINE, MODEL, assert_pool_idle
from tool_fixtures import ANTHROPIC_TOOLS, TOOLS

BS = ENGINE["block_size"]
TURNS = 12
SYSTEM = ("You are a travel agent. Use the tools to look up weather and local time before you "
          "answer, one call per turn, and keep every result in mind. ") * 4


def covered(prompt_tokens: int, completion_tokens: int) -> int:
    return (prompt_tokens + completion_tokens - 1) // BS * BS


def test_openai_agent_loop_reuses_every_previous_turn(server, client):
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Plan a week: weather in Paris, Oslo and Lima, and their times."}]
    previous = None
    per_turn = []
    for turn in range(TURNS):
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                           tool_choice="required", parallel_tool_calls=False,
                                           max_tokens=200, temperature=1.0, seed=turn)
        usage, message = r.usage, r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls"
        if previous is not None:
            per_turn.append((usage.prompt_tokens_details.cached_tokens, covered(*previous)))
        previous = (usage.prompt_tokens, usage.completion_tokens)
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            result = {"turn": turn, "tool": call.function.name, "value": 17.5 + turn}
            messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    print("openai turns (cached, previous turn block-aligned):", per_turn)
    assert len(per_turn) == TURNS - 1
    for cached, bound in per_turn:
        assert cached >= bound
    assert_pool_idle(server)


def test_anthropic_streamed_agent_loop_reuses_every_previous_turn(server, claude):
    messages = [{"role": "user", "content": "Weather and time for Paris, Oslo and Lima, please."}]
    previous = None
    per_turn = []
    for turn in range(TURNS):
        with claude.messages.stream(model=MODEL, max_tokens=200, system=SYSTEM, tools=ANTHROPIC_TOOLS,
                                    tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                    messages=messages, extra_body={"temperature": 1.0}) as stream:
            final = stream.get_final_message()
        assert final.stop_reason == "tool_use"
        usage = final.usage
        prompt_tokens = usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
        if previous is not None:
            per_turn.append((usage.cache_read_input_tokens, covered(*previous)))
        previous = (prompt_tokens, usage.output_tokens)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b.id, "content": f"result {turn}: {17.5 + turn} C"}
            for b in final.content if b.type == "tool_use"]})
    print("anthropic turns (cached, previous turn block-aligned):", per_turn)
    assert len(per_turn) == TURNS - 1
    for cached, bound in per_turn:
        assert cached >= bound
    assert_pool_idle(server)


def test_a_template_that_drops_earlier_reasoning_is_diagnosed_where_it_rewrites(server, client):
    thought = "The user wants Paris; call the weather tool first."
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Paris?"},
                {"role": "assistant", "reasoning_content": thought, "content": "Checking.",
                 "tool_calls": [{"id": "c1", "type": "function", "function": {
                     "name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 1}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "21 C"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                           max_tokens=4, temperature=0)
    later = messages + [{"role": "assistant", "content": "It is 21 C."},
                        {"role": "user", "content": "And Oslo?"}]
    second = client.chat.completions.create(model=MODEL, messages=later, tools=TOOLS, max_tokens=4,
                                            temperature=0, extra_body={"diagnose_against": first.id})
    d = second.model_extra["prefixserve"]["diagnosis"]
    assert d["compared_to"] == first.id
    # the prompts part where message 2's reasoning was: the earlier one shows it, this one not
    assert d["earlier_text"].startswith("<think>") and thought in d["earlier_text"]
    assert thought not in d["current_text"] and d["current_text"].startswith("Checking.")
    # the rewritten text belongs to no message of its own any more: the template renders it
    # only while message 2 is after the last user turn, so the span that owns the change is
    # the new user turn's, the message whose arrival made the template drop it
    assert d["part"] == "new user turn (message 5)"
    assert second.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens // BS * BS
