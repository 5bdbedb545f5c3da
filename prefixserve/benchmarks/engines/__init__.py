"""The engines the benchmark compares, each behind the same run(workload) -> RunResult interface."""
from prefixserve.benchmarks.engines.base import BenchEngine, RequestRecord, RunResult

ENGINE_NAMES = ("prefixserve", "hf-padded", "hf-reuse", "llama.cpp", "llama.cpp-q8_0")

__all__ = ["BenchEngine", "ENGINE_NAMES", "RequestRecord", "RunResult"]
