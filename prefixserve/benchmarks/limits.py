"""The machine's limits, measured in the benchmark's own process, and the model's cost per token.

Ideal prefill tokens/s = matmul peak / FLOPs per token; ideal decode steps/s =
memory bandwidth / bytes read per step (every weight once, plus the KV of every
sequence in the batch). A workload's ideal time computes only the tokens no
earlier request computed, at peak, and decodes each round's requests as one batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixserve.benchmarks.timing import best_seconds
from prefixserve.benchmarks.workloads import Workload
from prefixserve.model import ModelConfig
from prefixserve.platforms.cpu.linear import linear
from prefixserve.platforms.cpu.packed_weight import PackedWeight, applies as packing_applies


@dataclass(frozen=True)
class MachineLimits:
    matmul_flops: float         # FLOP/s of the faster of torch.mm and the projection kernel, best size
    matmul_by_size: dict        # n -> FLOP/s
    bandwidth_bytes: float      # bytes/s read by a reduction over a buffer far larger than the caches
    dtype: str
    threads: int

    def __post_init__(self) -> None:
        if self.matmul_flops <= 0 or self.bandwidth_bytes <= 0:
            raise ValueError("matmul_flops and bandwidth_bytes must be positive")


def measure_matmul(dtype: torch.dtype, sizes: tuple[int, ...] = (1024, 2048), repeat: int = 3) -> dict[int, float]:
    """FLOP/s of an n x n x n product for each n (2 n^3 FLOPs), by the faster of torch.mm and the
    kernel the model's projections use (on packed weights where the model packs them): the peak is what
    this machine can do, not what one library does."""
    return {n: _MatmulOperands(dtype, n).flops(repeat) for n in sizes}


class _MatmulOperands:
    def __init__(self, dtype: torch.dtype, n: int) -> None:
        self.n = n
        self.a = torch.randn(n, n).to(dtype)
        self.b = torch.randn(n, n).to(dtype)
        self.weight = PackedWeight(self.b) if packing_applies(self.b) else self.b

    def flops(self, repeat: int) -> float:
        seconds = min(best_seconds(lambda: torch.mm(self.a, self.b), repeat),
                      best_seconds(lambda: linear(self.a, self.weight), repeat))
        return 2 * self.n**3 / seconds


def bandwidth_buffer(quick: bool) -> torch.Tensor:
    """float32 ones far larger than the caches: 1 GiB, or 256 MiB for quick runs."""
    return torch.ones(((256 << 20) if quick else (1 << 30)) // 4, dtype=torch.float32)


def measure_bandwidth(buf: torch.Tensor, repeat: int = 3) -> float:
    """Bytes/s read by summing `buf` (decode reads weights much like this)."""
    return buf.numel() * buf.element_size() / best_seconds(lambda: buf.sum(), repeat)


class LimitProbe:
    """Both limits read in a few tens of milliseconds, to pair with one timed step after another: the
    operands are made once, the product is n = 1024, the sum over 256 MiB (8x the largest L3 seen here)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self._matmul = _MatmulOperands(dtype, 1024)
        self._buffer = torch.ones((256 << 20) // 4, dtype=torch.float32)

    def read(self) -> tuple[float, float]:
        """(matmul FLOP/s, bandwidth bytes/s), each the better of two tries."""
        return self._matmul.flops(2), measure_bandwidth(self._buffer, repeat=2)


def measure_limits(dtype: torch.dtype, quick: bool = False) -> MachineLimits:
    by_size = measure_matmul(dtype, (1024,) if quick else (1024, 2048), repeat=2 if quick else 3)
    bandwidth = measure_bandwidth(bandwidth_buffer(quick), repeat=2 if quick else 3)
    return MachineLimits(max(by_size.values()), by_size, bandwidth, str(dtype).removeprefix("torch."),
                         torch.get_num_threads())


@dataclass(frozen=True)
class ModelCost:
    """FLOPs and bytes of one decoder-only model, from its shape."""
    config: ModelConfig
    bytes_per_param: int

    @property
    def body_params(self) -> int:
        c = self.config
        attn = c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
        mlp = 3 * c.hidden_size * c.intermediate_size
        return c.num_hidden_layers * (attn + mlp)

    @property
    def head_params(self) -> int:
        return self.config.hidden_size * self.config.vocab_size

    @property
    def kv_bytes_per_token(self) -> int:
        c = self.config
        return c.num_hidden_layers * 2 * c.kv_size * self.bytes_per_param

    def attention_flops(self, context: int) -> float:
        """QK^T and PV for one query token attending to `context` positions."""
        c = self.config
        return 4.0 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * context

    def prefill_flops(self, num_tokens: int, start: int = 0) -> float:
        """Computing positions [start, start + num_tokens) of one sequence, logits for the last only."""
        attention = sum(self.attention_flops(p + 1) for p in range(start, start + num_tokens))
        return 2.0 * self.body_params * num_tokens + attention + 2.0 * self.head_params

    def decode_step(self, contexts: list[int]) -> tuple[float, float]:
        """(FLOPs, bytes read) of one decode step for sequences at these context lengths."""
        flops = sum(2.0 * (self.body_params + self.head_params) + self.attention_flops(c) for c in contexts)
        weights = (self.body_params + self.head_params) * self.bytes_per_param
        return flops, weights + self.kv_bytes_per_token * sum(contexts)


def batched_decode_bound_s(cost: ModelCost, limits: MachineLimits, contexts: list[int], shared: int) -> float:
    """The shortest possible decode step for sequences at these context lengths whose first `shared`
    positions are one run of K/V they all share: every weight and each distinct K/V byte read once
    at the measured bandwidth, or every FLOP at the measured peak, whichever takes longer."""
    flops, _ = cost.decode_step(contexts)
    distinct = shared + sum(c - shared for c in contexts)
    nbytes = (cost.body_params + cost.head_params) * cost.bytes_per_param + cost.kv_bytes_per_token * distinct
    return max(flops / limits.matmul_flops, nbytes / limits.bandwidth_bytes)


def ideal_prefill_tokens_per_s(cost: ModelCost, limits: MachineLimits, num_tokens: int) -> float:
    return num_tokens / (cost.prefill_flops(num_tokens) / limits.matmul_flops)


def ideal_decode_steps_per_s(cost: ModelCost, limits: MachineLimits, contexts: list[int]) -> float:
    flops, nbytes = cost.decode_step(contexts)
    return 1.0 / max(flops / limits.matmul_flops, nbytes / limits.bandwidth_bytes)


def ideal_workload_seconds(workload: Workload, cost: ModelCost, limits: MachineLimits) -> dict[str, float]:
    """Prefill of only the never-before-computed tokens at peak, plus each round decoding as one batch."""
    starts = {req.request_id: start for req, start in workload.computed_spans()}
    prefill = decode = 0.0
    for rnd in workload.rounds:
        for req in rnd:
            start = starts[req.request_id]
            prefill += cost.prefill_flops(len(req.prompt_token_ids) - start, start) / limits.matmul_flops
        for step in range(1, max(r.max_tokens for r in rnd)):
            contexts = [len(r.prompt_token_ids) + step for r in rnd if r.max_tokens > step]
            flops, nbytes = cost.decode_step(contexts)
            decode += max(flops / limits.matmul_flops, nbytes / limits.bandwidth_bytes)
    return {"prefill_s": prefill, "decode_s": decode, "total_s": prefill + decode}
