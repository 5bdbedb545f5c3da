"""The OpenAI Agents SDK (openai-agents) running a tool-using agent against prefixserve's
/v1/responses: the SDK streams the response, parses the function call, runs the Python tool and
ends on its result; a second run continues the first by previous_response_id. Oracles: the tool
saw arguments its own signature allows, the run's final output is what the tool returned, and the
second run's prompt finds the whole first turn in the cache (only identical tokens hit)."""
from __future__ import annotations

from typing import Literal

from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from live_server import ENGINE, MODEL, assert_pool_idle
from openai import AsyncOpenAI

BS = ENGINE["block_size"]
CITIES = ("Paris", "Oslo", "Lima")


def test_a_tool_using_agent_runs_and_continues_through_previous_response_id(server):
    set_tracing_disabled(True)  # the SDK would send traces to OpenAI
    seen: list[tuple[str, int]] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo", "Lima"], days: Literal[1, 2, 3]) -> str:
        """Weather forecast for a city."""
        seen.append((city, days))
        return f"{city}: 21 C for {days} days"

    client = AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    agent = Agent(name="travel", instructions="You are a travel agent. Look the weather up with the tool.",
                  tools=[get_weather], model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                               max_tokens=200, temperature=1.0),
                  tool_use_behavior="stop_on_first_tool")
    first = Runner.run_sync(agent, "Weather in Paris?")
    assert len(seen) == 1 and seen[0][0] in CITIES and seen[0][1] in (1, 2, 3)
    assert first.final_output == f"{seen[0][0]}: 21 C for {seen[0][1]} days"
    (response,) = first.raw_responses
    second = Runner.run_sync(agent, "And in Oslo?", previous_response_id=first.last_response_id)
    assert len(seen) == 2 and second.final_output == f"{seen[1][0]}: 21 C for {seen[1][1]} days"
    (again,) = second.raw_responses
    bound = (response.usage.input_tokens + response.usage.output_tokens - 1) // BS * BS
    assert again.usage.input_tokens_details.cached_tokens >= bound
    assert_pool_idle(server)
