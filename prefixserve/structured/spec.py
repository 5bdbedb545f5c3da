"""What a request asks its output to match, as plain data (no llguidance, no torch), so it can
travel in SamplingParams to the engine, the scheduler and the sampler."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from prefixserve.errors import InvalidRequestError

# Bounded: compiling takes memory and time (off the engine thread behind AsyncLLM, on it for
# LLMEngine.add_request), and one request must not hold up the others for long.
MAX_SPEC_CHARS = 256 * 1024
KINDS = ("json_schema", "json_object", "lark")


@dataclass(frozen=True)
class StructuredOutput:
    """kind "json_schema": `spec` is the schema as JSON text; "json_object": any JSON object
    (spec unused); "lark": `spec` is a grammar in llguidance's Lark dialect (how tool calls are
    constrained: literal tags around a %json schema)."""
    kind: Literal["json_schema", "json_object", "lark"]
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(f"structured output kind must be one of {KINDS}, "
                                      f"got {self.kind!r}", param="response_format")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_SPEC_CHARS:
            raise InvalidRequestError(f"a grammar must be a string of at most {MAX_SPEC_CHARS} "
                                      f"characters", param="response_format")

    @classmethod
    def json_schema(cls, schema: dict[str, Any]) -> StructuredOutput:
        # sort_keys would reorder "properties", and with it the order the keys are generated in
        return cls("json_schema", json.dumps(schema, ensure_ascii=False))
