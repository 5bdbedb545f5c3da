"""prefixserve: an LLM inference engine with a paged KV cache and automatic prefix caching.

The public names are imported lazily so that `prefixserve.kv` and
`prefixserve.scheduler` load without torch.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "prefixserve.engine.llm",
    "LLMEngine": "prefixserve.engine.llm_engine",
    "EngineConfig": "prefixserve.engine.config",
    "EngineStats": "prefixserve.engine.outputs",
    "RequestOutput": "prefixserve.engine.outputs",
    "CompletionOutput": "prefixserve.engine.outputs",
    "SamplingParams": "prefixserve.sampling_params",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'prefixserve' has no attribute {name!r}")
