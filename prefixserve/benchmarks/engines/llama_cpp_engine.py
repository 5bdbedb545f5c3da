"""llama.cpp through llama-cpp-python, on the same weights exported to GGUF in the same dtype.

Requests run one at a time (one Llama context = one sequence). Its prompt cache
is on, in both the forms it has: the context keeps the previous sequence and
`generate` re-evaluates only past the longest common prefix (the server's
cache_prompt), and a LlamaRAMCache of saved states keyed by token prefix is
consulted before and filled after each request, exactly the steps
Llama.create_completion takes when a cache is set. `generate` is driven
directly so every token id and its time are seen.
"""
from __future__ import annotations

import gc
import time
from pathlib import Path

from prefixserve.benchmarks.engines.base import OnRequestDone, RequestRecord, RunResult
from prefixserve.benchmarks.memory import peak_rss_bytes, reset_peak_rss
from prefixserve.benchmarks.workloads import Workload

GGML_TYPE_F32, GGML_TYPE_F16 = 0, 1
DEFAULT_CACHE_BYTES = 2 << 30  # LlamaRAMCache's own default


def llama_cpp_available() -> str | None:
    """None when llama-cpp-python imports, else why not."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return f"llama-cpp-python is not installed ({e})"
    return None


class LlamaCppEngine:
    name = "llama.cpp"

    def __init__(self, gguf_path: Path, *, threads: int, n_ctx: int, kv_f32: bool, vocab_limit: int) -> None:
        from llama_cpp import Llama
        self._kv_type = GGML_TYPE_F32 if kv_f32 else GGML_TYPE_F16
        self.llm = Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                         n_threads_batch=threads, type_k=self._kv_type, type_v=self._kv_type, verbose=False)
        import llama_cpp
        vocab = self.llm._model.vocab
        self._eog = [t for t in range(self.llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)]
        self._vocab_limit = vocab_limit

    def run(self, workload: Workload, on_done: OnRequestDone, cache_bytes: int = DEFAULT_CACHE_BYTES) -> RunResult:
        from llama_cpp import Llama, LlamaRAMCache
        llm = self.llm
        llm.reset()
        cache = LlamaRAMCache(capacity_bytes=cache_bytes)
        reset_peak_rss()
        records: list[RequestRecord] = []
        computed = 0
        start = time.monotonic()
        for rnd in workload.rounds:
            arrival = time.monotonic()
            for r in rnd:
                prompt = list(r.prompt_token_ids)
                try:  # Llama._create_completion's cache lookup
                    item = cache[prompt]
                    if (Llama.longest_token_prefix(item.input_ids.tolist(), prompt)
                            > Llama.longest_token_prefix(llm._input_ids.tolist(), prompt)):
                        llm.load_state(item)
                except KeyError:
                    pass
                # What generate will keep: the common prefix with the context, never the whole prompt.
                kept = min(Llama.longest_token_prefix(llm._input_ids.tolist(), prompt), len(prompt) - 1)
                computed += len(prompt) - kept
                out: list[int] = []
                times: list[float] = []
                for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                          logits_processor=[self._ban_eog]):
                    out.append(int(token))
                    times.append(time.monotonic())
                    if len(out) == r.max_tokens:
                        break
                records.append(RequestRecord(r.request_id, len(prompt), kept, out, times[0] - arrival,
                                             times[-1] - arrival))
                cache[prompt + out] = llm.save_state()  # ... and its cache save
                on_done()
        kv = "f32" if self._kv_type == GGML_TYPE_F32 else "f16"
        return RunResult(self.name, workload.name, records, time.monotonic() - start, computed, peak_rss_bytes(),
                         note=f"one request at a time; KV {kv}; RAM prompt cache {cache_bytes >> 20} MiB")

    def _ban_eog(self, input_ids, scores):
        # Every engine generates exactly max_tokens (ignore_eos), so all do the same work, and samples
        # only ids the tokenizer has, as prefixserve does.
        scores[self._eog] = -float("inf")
        scores[self._vocab_limit:] = -float("inf")
        return scores

    def close(self) -> None:
        self.llm.close()
        del self.llm
        gc.collect()
