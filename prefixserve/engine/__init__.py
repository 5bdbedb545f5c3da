from prefixserve.engine.async_llm import AsyncLLM
from prefixserve.engine.cached_contents import CachedContent
from prefixserve.engine.client import EngineClient
from prefixserve.engine.config import EngineConfig
from prefixserve.engine.dtype_resolution import with_concrete_dtype
from prefixserve.engine.llm import LLM
from prefixserve.engine.llm_engine import LLMEngine
from prefixserve.engine.outputs import (CachePin, CompletionOutput, EngineInfo, EngineStats, PinInfo, PinResult,
                                       RequestMetrics, RequestOutput)

__all__ = ["AsyncLLM", "CachePin", "CachedContent", "CompletionOutput", "EngineClient", "EngineConfig", "EngineInfo",
           "EngineStats", "LLM", "LLMEngine", "PinInfo", "PinResult", "RequestMetrics", "RequestOutput",
           "with_concrete_dtype"]
