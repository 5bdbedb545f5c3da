"""Micro-benchmark of the model layer alone: one-sequence prefill and batch-1 decode through the paged pool.

Reports throughput next to this machine's limits measured in the same run
(matmul peak, memory bandwidth), because absolute numbers drift between runs
on shared CPUs while ratios hold. With --hf, HF transformers runs on the very
same weights, interleaved with ours round by round, as a same-run baseline.
Every figure is the best of --rounds rounds, which filters out the time slices
other processes take.

    python -m prefixserve.benchmarks.model_micro [--model random:qwen3-0.6b] [--hf]
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from prefixserve.model.attention.metadata import AttentionMetadata
from prefixserve.model.config import ModelConfig, resolve_dtype
from prefixserve.model.hf_weights import hf_weight_targets
from prefixserve.model.kv_layout import kv_cache_shape
from prefixserve.platforms.cpu.linear import linear
from prefixserve.model.loader import LoadedModel, load_model

BLOCK_SIZE = 16


@dataclass
class Result:
    model: str
    dtype: str
    threads: int
    prompt_tokens: int
    prefill_tok_s: float
    decode_tok_s: float
    matmul_peak_gflop_s: float
    bandwidth_gb_s: float
    prefill_pct_of_peak: float        # body + one LM-head row FLOPs / time, over the matmul peak
    decode_pct_of_bandwidth: float    # (weights + KV pool) bytes per step / time, over the bandwidth
    hf_prefill_tok_s: float | None = None
    hf_decode_tok_s: float | None = None


class Timings:
    """Keeps the best (shortest) time seen for each named measurement."""

    def __init__(self) -> None:
        self.best: dict[str, float] = {}

    def time(self, name: str, fn: Callable[[], object]) -> None:
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        self.best[name] = min(elapsed, self.best.get(name, float("inf")))


def body_flops_per_token(config: ModelConfig) -> float:
    """2 * (matmul parameters of the layers): the body's FLOPs per token, attention scores excluded."""
    per_layer = config.hidden_size * (2 * config.q_size + 2 * config.kv_size) + \
        3 * config.hidden_size * config.intermediate_size
    return 2.0 * per_layer * config.num_hidden_layers


class OurModel:
    def __init__(self, loaded: LoadedModel, dtype: torch.dtype, prompt: torch.Tensor, decode_steps: int) -> None:
        self.lm, config = loaded.model, loaded.config
        self.prompt, self.decode_steps = prompt, decode_steps
        num_blocks = -(-(len(prompt) + decode_steps) // BLOCK_SIZE)
        self.caches = [torch.zeros(kv_cache_shape(config, num_blocks, BLOCK_SIZE), dtype=dtype)
                       for _ in range(config.num_hidden_layers)]
        # a reversed block table: the pool is read through real indirection, not a contiguous run
        self.table = list(reversed(range(num_blocks)))
        self.bytes_per_step = sum(t.numel() * t.element_size() for t in [*self.lm.parameters(), *self.caches])

    @torch.inference_mode()
    def prefill(self) -> int:
        n = len(self.prompt)
        meta = AttentionMetadata.build([n], [n], [self.table], BLOCK_SIZE)
        hidden = self.lm(self.prompt, torch.arange(n), self.caches, meta)
        return int(self.lm.compute_logits(hidden[-1:]).argmax())

    @torch.inference_mode()
    def decode(self, token: int) -> None:
        for pos in range(len(self.prompt), len(self.prompt) + self.decode_steps):
            meta = AttentionMetadata.build([1], [pos + 1], [self.table], BLOCK_SIZE)
            hidden = self.lm(torch.tensor([token]), torch.tensor([pos]), self.caches, meta)
            token = int(self.lm.compute_logits(hidden).argmax())


class HFModel:
    """transformers' implementation of the same architecture, holding copies of our weights."""

    def __init__(self, loaded: LoadedModel, dtype: torch.dtype, prompt: torch.Tensor, decode_steps: int) -> None:
        from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                                  Qwen3ForCausalLM)
        classes = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                   "llama": (LlamaConfig, LlamaForCausalLM)}
        c = loaded.config
        config_cls, model_cls = classes[c.architecture]
        hf_config = config_cls(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
            num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
            head_dim=c.head_dim, intermediate_size=c.intermediate_size, rms_norm_eps=c.rms_norm_eps,
            rope_theta=c.rope_theta, rope_scaling=c.rope_scaling,
            max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings)
        with torch.device("meta"):
            model = model_cls(hf_config)
        model = model.to_empty(device="cpu").to(dtype)
        model.load_state_dict({k: v.contiguous() for k, v in hf_weight_targets(loaded.model).items()},
                              strict=False)
        if c.tie_word_embeddings:
            model.tie_weights()
        self.model = model.eval()
        self.prompt, self.decode_steps = prompt[None], decode_steps
        self.cache = None

    @torch.inference_mode()
    def prefill(self) -> torch.Tensor:
        out = self.model(self.prompt, use_cache=True, logits_to_keep=1)
        self.cache = out.past_key_values
        return out.logits[:, -1:].argmax(-1)

    @torch.inference_mode()
    def decode(self, token: torch.Tensor) -> None:
        for _ in range(self.decode_steps):
            out = self.model(token, past_key_values=self.cache, use_cache=True)
            self.cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)


def matmul_once(dtype: torch.dtype, n: int = 2048) -> tuple[Callable[[], object], Callable[[], object]]:
    """One n x n x n product through torch.mm and through the model's projection kernel."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return (lambda: torch.mm(a, b)), (lambda: linear(a, b))


def main(argv: list[str] | None = None) -> Result:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:qwen3-0.6b")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf", action="store_true", help="also time HF transformers on the same weights")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype)

    loaded = load_model(args.model, dtype=dtype, seed=args.seed)
    config = loaded.config
    prompt = torch.randint(0, min(config.vocab_size, 8192), (args.prompt_len,),
                           generator=torch.Generator().manual_seed(args.seed))
    ours = OurModel(loaded, dtype, prompt, args.decode_steps)
    hf = HFModel(loaded, dtype, prompt, args.decode_steps) if args.hf else None
    mm, mm_linear = matmul_once(dtype)
    big = torch.ones(2 ** 28)  # 1 GiB of float32 to stream through
    timings = Timings()
    for _ in range(args.rounds + 1):  # the first round warms caches and oneDNN primitives
        timings.time("matmul", mm)
        timings.time("matmul_linear", mm_linear)
        timings.time("stream", big.sum)
        timings.time("prefill", ours.prefill)
        token = ours.prefill()
        timings.time("decode", lambda: ours.decode(token))
        if hf is not None:
            timings.time("hf_prefill", hf.prefill)
            hf_token = hf.prefill()
            timings.time("hf_decode", lambda: hf.decode(hf_token))

    best = timings.best
    # the peak is the faster of torch.mm and the projections' own kernel
    peak = 2 * 2048 ** 3 / min(best["matmul"], best["matmul_linear"]) / 1e9
    bandwidth = big.numel() * 4 / best["stream"] / 1e9
    prefill_flops = body_flops_per_token(config) * args.prompt_len + 2 * config.hidden_size * config.vocab_size
    decode_tok_s = args.decode_steps / best["decode"]
    result = Result(
        model=args.model, dtype=args.dtype, threads=args.threads, prompt_tokens=args.prompt_len,
        prefill_tok_s=args.prompt_len / best["prefill"],
        decode_tok_s=decode_tok_s,
        matmul_peak_gflop_s=peak, bandwidth_gb_s=bandwidth,
        prefill_pct_of_peak=100 * prefill_flops / best["prefill"] / 1e9 / peak,
        decode_pct_of_bandwidth=100 * ours.bytes_per_step * decode_tok_s / 1e9 / bandwidth,
    )
    if hf is not None:
        result.hf_prefill_tok_s = args.prompt_len / best["hf_prefill"]
        result.hf_decode_tok_s = args.decode_steps / best["hf_decode"]
    print(json.dumps(asdict(result), indent=2))
    return result


if __name__ == "__main__":
    main()
