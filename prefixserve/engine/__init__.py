from prefixserve.engine.config import EngineConfig
from prefixserve.engine.llm import LLM
from prefixserve.engine.llm_engine import LLMEngine
from prefixserve.engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput

__all__ = ["CompletionOutput", "EngineConfig", "EngineStats", "LLM", "LLMEngine", "RequestMetrics",
           "RequestOutput"]
