"""prefixserve: an LLM inference engine with a paged KV cache and automatic prefix caching."""
from prefixserve.engine import (CompletionOutput, EngineConfig, EngineStats, LLM, LLMEngine,
                                RequestOutput)
from prefixserve.sampling_params import SamplingParams

__all__ = ["CompletionOutput", "EngineConfig", "EngineStats", "LLM", "LLMEngine", "RequestOutput",
           "SamplingParams"]
__version__ = "0.1.0"
