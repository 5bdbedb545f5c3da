"""The limits math: model cost against an independent count (transformers' own parameters) and known figures."""
from __future__ import annotations

import statistics

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from prefixserve.benchmarks.checkpoint import hf_config_dict
from prefixserve.benchmarks.limits import (MachineLimits, ModelCost, batched_decode_bound_s, ideal_decode_steps_per_s,
                                           ideal_prefill_tokens_per_s, ideal_workload_seconds, measure_bandwidth,
                                           measure_matmul)
from prefixserve.benchmarks.workloads import BenchRequest, Workload
from prefixserve.model import RANDOM_PRESETS


def _limits(flops: float, bandwidth: float) -> MachineLimits:
    return MachineLimits(flops, {1024: flops}, bandwidth, "float32", 2)


def test_body_params_match_transformers_parameter_count() -> None:
    config = RANDOM_PRESETS["qwen3-tiny"]
    hf = Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in hf_config_dict(config, torch.float32).items()
                                         if k not in ("architectures", "model_type", "torch_dtype")}))
    linear = sum(m.weight.numel() for name, m in hf.named_modules()
                 if isinstance(m, torch.nn.Linear) and name.startswith("model.layers"))
    cost = ModelCost(config, 4)
    assert cost.body_params == linear
    assert cost.head_params == hf.lm_head.weight.numel()


def test_qwen3_06b_figures_match_the_published_shape() -> None:
    # Independent figures (PERF-NOTES): 440.5M body parameters, 0.881 GFLOP per token, 0.311 GFLOP per logit
    # row, ~596M parameters read per decode step -> ~13.6 steps/s in fp32 at 32.5 GB/s.
    cost = ModelCost(RANDOM_PRESETS["qwen3-0.6b"], 4)
    assert cost.body_params / 1e6 == pytest.approx(440.5, abs=0.1)
    assert 2 * cost.body_params / 1e9 == pytest.approx(0.881, abs=0.001)
    assert 2 * cost.head_params / 1e9 == pytest.approx(0.311, abs=0.001)
    assert ideal_decode_steps_per_s(cost, _limits(1e15, 32.5e9), [1]) == pytest.approx(13.6, abs=0.1)


def test_prefill_flops_count_attention_over_every_position() -> None:
    cost = ModelCost(RANDOM_PRESETS["qwen3-tiny"], 4)
    c = cost.config
    n, start = 5, 7
    # Brute force: each token's query attends to every earlier position and itself, QK^T + PV per head.
    attention = sum(2 * 2 * c.head_dim * (pos + 1) * c.num_attention_heads * c.num_hidden_layers
                    for pos in range(start, start + n))
    expected = n * 2 * cost.body_params + attention + 2 * cost.head_params
    assert cost.prefill_flops(n, start) == pytest.approx(expected)
    assert ideal_prefill_tokens_per_s(cost, _limits(1e12, 1e10), 512) == pytest.approx(
        512 * 1e12 / cost.prefill_flops(512))


def test_decode_reads_weights_once_and_every_sequences_kv() -> None:
    cost = ModelCost(RANDOM_PRESETS["qwen3-tiny"], 4)
    c = cost.config
    flops, nbytes = cost.decode_step([10, 20])
    weights = (cost.body_params + cost.head_params) * 4
    kv_per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 4
    assert nbytes == weights + kv_per_token * 30
    # Memory-bound limits take the bandwidth; compute-bound ones the FLOPs.
    assert ideal_decode_steps_per_s(cost, _limits(1e15, 1e9), [10, 20]) == pytest.approx(1e9 / nbytes)
    assert ideal_decode_steps_per_s(cost, _limits(1e3, 1e15), [10, 20]) == pytest.approx(1e3 / flops)


def test_batched_decode_bound_reads_a_shared_prefix_once() -> None:
    """16 sequences of a 1024-token shared document + 40 own tokens: the weights, the document's K/V
    once and each sequence's own K/V (counted by hand), or the FLOPs, whichever is slower."""
    cost = ModelCost(RANDOM_PRESETS["qwen3-tiny"], 4)
    c = cost.config
    contexts = [1024 + 40] * 16
    weights = (cost.body_params + cost.head_params) * 4
    kv_per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 4
    memory_bound = _limits(1e18, 1e9)
    assert batched_decode_bound_s(cost, memory_bound, contexts, 1024) == pytest.approx(
        (weights + kv_per_token * (1024 + 16 * 40)) / 1e9)
    # nothing shared: every sequence's K/V, as the unshared decode step counts it
    assert batched_decode_bound_s(cost, memory_bound, contexts, 0) == pytest.approx(
        1 / ideal_decode_steps_per_s(cost, memory_bound, contexts))
    flops, _ = cost.decode_step(contexts)
    assert batched_decode_bound_s(cost, _limits(1e3, 1e18), contexts, 1024) == pytest.approx(flops / 1e3)


def test_workload_ideal_time_counts_only_uncached_tokens() -> None:
    cost = ModelCost(RANDOM_PRESETS["qwen3-tiny"], 4)
    lim = _limits(1e9, 1e15)
    prefix = tuple(range(100, 164))
    shared = Workload("s", "", 0, ((BenchRequest("a", prefix + (1, 2), 1), BenchRequest("b", prefix + (3, 4), 1)),))
    alone = Workload("u", "", 0, ((BenchRequest("a", prefix + (1, 2), 1),),))
    t_shared = ideal_workload_seconds(shared, cost, lim)
    t_alone = ideal_workload_seconds(alone, cost, lim)
    # b computes only its two new tokens (positions 64, 65) plus its logits row.
    extra = cost.prefill_flops(2, 64) / 1e9
    assert t_shared["prefill_s"] == pytest.approx(t_alone["prefill_s"] + extra)
    assert t_shared["decode_s"] == 0.0  # max_tokens 1: the only token comes from the prefill


def test_measured_limits_are_positive_and_plausible() -> None:
    by_size = measure_matmul(torch.float32, sizes=(128,), repeat=1)
    assert 1e6 < by_size[128] < 1e14
    assert 1e7 < measure_bandwidth(torch.ones((8 << 20) // 4), repeat=1) < 1e13
    with pytest.raises(ValueError, match="positive"):
        _limits(0.0, 1.0)


def test_batched_decode_pairs_each_step_with_the_reading_just_before_it(monkeypatch) -> None:
    """Every decode step of long-doc-qa's requests (quick: 4 questions over 256 shared tokens) is set against
    the bound at the reading taken just before it, at the contexts the sequences have in that step; the
    prefill steps are not counted."""
    from prefixserve import EngineConfig, LLMEngine
    from prefixserve.benchmarks import roofline
    from prefixserve.benchmarks.workloads import build_workload
    readings = iter([(1e9 * (i + 1), 1e8 * (i + 1)) for i in range(100)])
    taken, bounds = [], []
    monkeypatch.setattr(roofline.LimitProbe, "read", lambda self: taken.append(next(readings)) or taken[-1])
    real_bound = roofline.batched_decode_bound_s

    def bound(cost, limits, contexts, shared):
        assert (limits.matmul_flops, limits.bandwidth_bytes) == taken[-1]
        bounds.append((list(contexts), shared, real_bound(cost, limits, contexts, shared)))
        return bounds[-1][2]

    monkeypatch.setattr(roofline, "batched_decode_bound_s", bound)
    engine = LLMEngine(EngineConfig(model="random:qwen3-tiny", dtype="float32", num_kv_blocks=256))
    cost = ModelCost(RANDOM_PRESETS["qwen3-tiny"], 4)
    out = roofline.measure_batched_decode(engine, cost, _limits(1e9, 1e8), quick=True)
    rnd = build_workload("long-doc-qa", quick=True).rounds[0]
    assert out["steps"] == 6 == len(bounds) == len(taken)
    for step, (contexts, shared, _) in enumerate(bounds):
        assert shared == 256
        assert contexts == [len(r.prompt_token_ids) + 1 + step for r in rnd]
    assert out["sequences"] == 4 and not engine.has_unfinished_requests()
    assert out["bandwidth_bytes"] == pytest.approx(statistics.median(b for _, b in taken))
    # the ratios are step / bound per pair: the median step time over the smallest bound is an upper limit
    assert 0 < out["ratio"] <= out["step_s"] / min(b for *_, b in bounds) + 1e-12
