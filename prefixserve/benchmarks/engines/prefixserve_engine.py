"""prefixserve driven through its public LLMEngine API, one round of requests at a time."""
from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Optional

from prefixserve import EngineConfig, LLMEngine, SamplingParams
from prefixserve.benchmarks.engines.base import OnRequestDone, RequestRecord, RunResult
from prefixserve.benchmarks.memory import peak_rss_bytes, reset_peak_rss
from prefixserve.benchmarks.workloads import Workload


class PrefixServeEngine:
    """One LLMEngine; `warm` runs keep whatever the previous run left in the prefix cache."""

    def __init__(self, name: str, model: Path | str, dtype: str, *, prefix_caching: bool = True,
                 num_kv_blocks: Optional[int] = None, kv_cache_memory: Optional[int] = None,
                 warm: bool = False) -> None:
        self.name = name
        self.warm = warm
        self.engine = LLMEngine(EngineConfig(model=str(model), dtype=dtype, enable_prefix_caching=prefix_caching,
                                             num_kv_blocks=num_kv_blocks, kv_cache_memory=kv_cache_memory))

    def run(self, workload: Workload, on_done: OnRequestDone) -> RunResult:
        engine = self.engine
        if not self.warm:
            engine.reset_prefix_cache()
        before = engine.stats()
        reset_peak_rss()
        records: list[RequestRecord] = []
        start = time.monotonic()
        for rnd in workload.rounds:
            arrival = time.monotonic()
            for req in rnd:
                engine.add_request(req.request_id, list(req.prompt_token_ids),
                                   SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True),
                                   cache_salt=req.cache_salt, arrival_time=arrival)
            pending = {r.request_id for r in rnd}
            while pending:
                for out in engine.step():
                    if not out.finished:
                        continue
                    if out.error:
                        raise RuntimeError(f"{self.name}: request {out.request_id} failed: {out.error}")
                    m = out.metrics
                    records.append(RequestRecord(out.request_id, len(out.prompt_token_ids), out.num_cached_tokens,
                                                 list(out.outputs[0].token_ids), m.first_token_time - arrival,
                                                 m.finished_time - arrival))
                    pending.discard(out.request_id)
                    on_done()
        wall = time.monotonic() - start
        after = engine.stats()
        return RunResult(self.name, workload.name, records, wall,
                         after.computed_prompt_tokens - before.computed_prompt_tokens, peak_rss_bytes(),
                         extra={"steps": after.steps - before.steps,
                                "preemptions": after.preemptions - before.preemptions,
                                "evictions": after.evictions - before.evictions,
                                "kv_cache_bytes": after.kv_cache_bytes})

    def close(self) -> None:
        """Frees the weights and KV pool now; safe to call twice."""
        if self.__dict__.pop("engine", None) is not None:
            gc.collect()
