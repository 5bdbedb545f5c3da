"""Request body of POST /v1/responses, OpenAI's Responses API as far as prefixserve serves it.

Validation is strict like the other bodies (no coercion) and unknown fields are refused at any
depth (fields.py). Input items are free-form objects here, checked one by one by items.py, which
names the item and the key of whatever is wrong (`input[3].call_id`). Responses are built as
plain dicts (responses/objects.py) in OpenAI's wire format.
"""
from __future__ import annotations

from typing import Any, ClassVar, Optional, Union

from prefixserve.entrypoints.server.fields import Shape, Unsupported
from prefixserve.entrypoints.server.prompt_cache_fields import BREAKPOINT_KEYS, PromptCacheRequest
from prefixserve.entrypoints.server.protocol import DiagnoseFields, StrictModel

# image and file parts are known, so that they are refused as unsupported parts, not unknown keys
PART_KEYS: Shape = {"type": None, "text": None, "annotations": None, "logprobs": None,
                    "prompt_cache_breakpoint": BREAKPOINT_KEYS, "image_url": None, "file_id": None,
                    "detail": None, "file_data": None, "file_url": None, "filename": None}
ITEM_KEYS: Shape = {"type": None, "id": None, "status": None, "role": None, "content": PART_KEYS,
                    "call_id": None, "name": None, "arguments": None, "output": PART_KEYS,
                    "phase": None}
TOOL_KEYS: Shape = {"type": None, "name": None, "description": None, "parameters": None, "strict": None}
FORMAT_KEYS: Shape = {"type": None, "name": None, "description": None, "schema": None, "strict": None}


def _off(value: Any) -> bool:
    return value is None or value is False


def _no_reasoning(value: Any) -> bool:
    return value is None or (isinstance(value, dict) and value.get("effort") in (None, "none", "minimal")
                             and value.get("summary") is None)


class TextOptions(StrictModel):
    field_keys: ClassVar[dict[str, Shape]] = {"format": FORMAT_KEYS}
    # {"type": "text" | "json_object" | "json_schema", "name", "schema", "strict"}
    format: Optional[dict[str, Any]] = None
    # ignored: how long a reasoning model's answer should be; nothing here reasons
    verbosity: Optional[str] = None


class StreamOptions(StrictModel):
    # ignored: padding that hides chunk sizes on the wire; nothing a client reads
    include_obfuscation: Optional[bool] = None


class ResponsesRequest(DiagnoseFields, PromptCacheRequest):
    unsupported: ClassVar[dict[str, Unsupported]] = {
        "background": Unsupported("responses are generated while the request waits", _off),
        "conversation": Unsupported("conversations are continued by previous_response_id"),
        "prompt": Unsupported("stored prompt templates are not implemented"),
        "reasoning": Unsupported("reasoning options are not implemented (effort \"none\" is accepted)",
                                 _no_reasoning),
        "top_logprobs": Unsupported("log probabilities are not returned by /v1/responses",
                                    lambda v: v is None or v == 0),
        "max_tool_calls": Unsupported("built-in tools are not implemented; function calls are "
                                      "bounded by max_output_tokens"),
        "context_management": Unsupported("context compaction is not implemented"),
    }
    field_keys: ClassVar[dict[str, Shape]] = {
        "input": ITEM_KEYS,
        "tools": TOOL_KEYS,
        "tool_choice": {"type": None, "name": None},
    }
    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]], None] = None
    instructions: Optional[str] = None
    previous_response_id: Optional[str] = None
    # Keep the response (its items and exact tokens) so previous_response_id can continue it.
    store: bool = True
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[TextOptions] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    # Echoed on the response and otherwise ignored (docs/api-fields.md).
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    service_tier: Optional[str] = None
    truncation: Optional[str] = None
    include: Optional[list[str]] = None
    # prefixserve extensions, as on the other endpoints.
    top_k: Optional[int] = None
    seed: Optional[int] = None
    priority: int = 0
