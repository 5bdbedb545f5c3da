"""The tools the server's tool-call tests offer (OpenAI and Anthropic shapes), the conversation that
asks for them, and the check every returned call must pass: its arguments are JSON that the
tool's own schema accepts (jsonschema_rs, independent of our grammar code)."""
from __future__ import annotations

import json

import jsonschema_rs

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"type": "string", "enum": ["C", "F"]}},
    "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
         "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time",
                                           "parameters": CLOCK}}]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
MESSAGES = [{"role": "system", "content": "You are a travel agent with tools."},
            {"role": "user", "content": "What is the weather in Paris for three days?"}]


def assert_valid_call(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema_rs.validate(SCHEMAS[name], args)
    return args
