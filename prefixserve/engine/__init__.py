from prefixserve.engine.async_llm import AsyncLLM
from prefixserve.engine.config import EngineConfig
from prefixserve.engine.llm import LLM
from prefixserve.engine.llm_engine import LLMEngine
from prefixserve.engine.outputs import (CachePin, CompletionOutput, EngineStats, PinResult,
                                       RequestMetrics, RequestOutput)

__all__ = ["AsyncLLM", "CachePin", "CompletionOutput", "PinResult", "EngineConfig", "EngineStats", "LLM", "LLMEngine", "RequestMetrics",
           "RequestOutput"]
