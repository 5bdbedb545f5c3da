"""Hugging Face transformers baselines on the benchmark's checkpoint folder.

hf-padded: each round is one `generate` call over a left-padded batch; nothing
is reused. hf-reuse: what a careful user writes by hand with transformers' own
cache objects: each shared prefix is computed once into a DynamicCache, a deep
copy of it serves each request, only the request's own suffix is prefilled,
and requests run one at a time (a per-request cache cannot be batched).
"""
from __future__ import annotations

import copy
import gc
import time
import warnings
from pathlib import Path

import torch
from transformers import (AutoModelForCausalLM, DynamicCache, LogitsProcessor, LogitsProcessorList,
                          StoppingCriteria, StoppingCriteriaList)
from transformers.utils import logging as hf_logging

from prefixserve.benchmarks.engines.base import OnRequestDone, RequestRecord, RunResult, tokenizer_vocab_size
from prefixserve.benchmarks.memory import peak_rss_bytes, reset_peak_rss
from prefixserve.benchmarks.workloads import BenchRequest, Workload


class _TokenClock(StoppingCriteria):
    """Timestamps every generated token (generate calls its stopping criteria once per token)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        self.times.append(time.monotonic())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class _VocabLimit(LogitsProcessor):
    def __init__(self, limit: int) -> None:
        self.limit = limit

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores[:, self.limit:] = -float("inf")
        return scores


class _HFModel:
    def __init__(self, folder: Path, dtype: str) -> None:
        hf_logging.disable_progress_bar()  # it would interleave with the benchmark's own progress bars
        self.model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype),
                                                          attn_implementation="sdpa").eval()
        self.pad_id = 0
        self.vocab_limit = tokenizer_vocab_size(folder)

    @classmethod
    def sharing(cls, other: "_HFModel") -> "_HFModel":
        """An engine of this kind on `other`'s already loaded model (one copy of the weights)."""
        engine = cls.__new__(cls)
        engine.model, engine.pad_id, engine.vocab_limit = other.model, other.pad_id, other.vocab_limit
        return engine

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_tokens: int,
                 cache: DynamicCache | None = None) -> tuple[torch.Tensor, list[float]]:
        clock = _TokenClock()
        # transformers 5 renames past_key_values to cache; the old name keeps 4.x working too.
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "`past_key_values` is deprecated", FutureWarning)
            out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache,
                                      max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                      pad_token_id=self.pad_id, stopping_criteria=StoppingCriteriaList([clock]),
                                      logits_processor=LogitsProcessorList([_VocabLimit(self.vocab_limit)]))
        return out[:, input_ids.shape[1]:], clock.times

    def close(self) -> None:
        del self.model
        gc.collect()


class HFPaddedEngine(_HFModel):
    name = "hf-padded"

    def run(self, workload: Workload, on_done: OnRequestDone) -> RunResult:
        reset_peak_rss()
        records: list[RequestRecord] = []
        computed = 0
        start = time.monotonic()
        for rnd in workload.rounds:
            arrival = time.monotonic()
            width = max(len(r.prompt_token_ids) for r in rnd)
            ids = torch.full((len(rnd), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(rnd), width), dtype=torch.long)
            for i, r in enumerate(rnd):
                ids[i, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
                mask[i, width - len(r.prompt_token_ids):] = 1
            max_tokens = max(r.max_tokens for r in rnd)
            out, times = self.generate(ids, mask, max_tokens)
            computed += ids.numel()
            for i, r in enumerate(rnd):
                records.append(RequestRecord(r.request_id, len(r.prompt_token_ids), 0,
                                             out[i, :r.max_tokens].tolist(), times[0] - arrival,
                                             times[r.max_tokens - 1] - arrival))
                on_done()
        return RunResult(self.name, workload.name, records, time.monotonic() - start, computed, peak_rss_bytes(),
                         note="padding counted as computed")


class HFReuseEngine(_HFModel):
    name = "hf-reuse"

    def run(self, workload: Workload, on_done: OnRequestDone) -> RunResult:
        reset_peak_rss()
        # shared prefix tokens -> the cache after prefilling exactly those tokens
        store: dict[tuple[int, ...], DynamicCache] = {}
        records: list[RequestRecord] = []
        computed = 0
        start = time.monotonic()
        for rnd in workload.rounds:
            arrival = time.monotonic()
            for r in rnd:
                cache, cached = None, 0
                if r.shared_prefix_len:
                    computed += self._ensure_prefix(store, r)
                    cached = r.shared_prefix_len
                    cache = copy.deepcopy(store[r.prompt_token_ids[:cached]])
                ids = torch.tensor([r.prompt_token_ids])
                out, times = self.generate(ids, torch.ones_like(ids), r.max_tokens, cache)
                computed += len(r.prompt_token_ids) - cached
                records.append(RequestRecord(r.request_id, len(r.prompt_token_ids), cached, out[0].tolist(),
                                             times[0] - arrival, times[-1] - arrival))
                on_done()
        return RunResult(self.name, workload.name, records, time.monotonic() - start, computed, peak_rss_bytes(),
                         note="one request at a time")

    def _ensure_prefix(self, store: dict[tuple[int, ...], DynamicCache], r: BenchRequest) -> int:
        """Makes store hold r's shared prefix, extending the longest stored prefix of it; returns tokens computed."""
        prefix = r.prompt_token_ids[:r.shared_prefix_len]
        if prefix in store:
            return 0
        base = max((k for k in store if prefix[:len(k)] == k), key=len, default=())
        # The entry being extended is superseded (a conversation's older history): drop it.
        cache = store.pop(base) if base else DynamicCache(config=self.model.config)
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "`past_key_values` is deprecated", FutureWarning)
            self.model(input_ids=torch.tensor([prefix[len(base):]]), past_key_values=cache, use_cache=True,
                       logits_to_keep=1)
        store[prefix] = cache
        return len(prefix) - len(base)
