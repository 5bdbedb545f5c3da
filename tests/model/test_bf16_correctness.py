"""bfloat16 against a float64 reference and against HF transformers in bfloat16, on the same checkpoint.

The reference is HF transformers in float64 on the float32 checkpoint. The tolerance comes from
bfloat16 rounding itself, measured independently of our code: the same float64 model run with
its weights rounded to bfloat16 and every linear's, norm's and layer's inputs and outputs
rounded to bfloat16 (forward hooks), the precision a bfloat16 model holds between its
float32-accumulating kernels. Its logits move by `e_sim` from the reference; any bfloat16
implementation makes rounding errors of that size, landing on other values, so its error may be
up to twice e_sim's worst (TOLERANCE_FACTOR) and its root mean square error up to 1.5 times
e_sim's (a bug that loses float32 accumulation or rounds twice as often shows there first).
HF transformers in bfloat16 is held to the same bounds, which shows they are attainable and
not fitted to our numbers.

No logit can be off by more than the tolerance, so the argmax can differ from the reference's
only where the reference's top-2 margin is under twice it: everywhere else the greedy token
must be the reference's. Our logits come through the paged pool exactly as served: a prefill
step, a continuation chunk over another sequence's cached blocks, and decode steps where three
sequences share their leading blocks (the shared-run decode path).
"""
from __future__ import annotations

import pytest
import torch

from bf16_reference import (BLOCK_SIZE, MIN_DECISIVE, bounds, hf_logits, hf_model, max_errors, our_logits, references,
                            sequences)
from prefixserve import LLM, SamplingParams

@pytest.fixture(scope="module", params=["qwen3", "qwen2", "llama"])
def case(request, tiny_checkpoint):
    path = tiny_checkpoint(request.param)
    tokens = sequences(seed=11)
    return request.param, path, tokens, *references(path, tokens)


@pytest.mark.parametrize("implementation", ["prefixserve", "transformers"])
def test_bf16_logits_within_rounding_tolerance_of_float64(case, implementation) -> None:
    arch, path, tokens, reference, simulated = case
    tolerance, rms_bound = bounds(reference, simulated)
    logits = (our_logits(path, "bfloat16", tokens) if implementation == "prefixserve"
              else hf_logits(hf_model(path, torch.bfloat16), tokens))
    errors = max_errors(logits, reference)
    print(f"\n{arch} {implementation}: max {errors.max():.3f} (tolerance {tolerance:.3f}), "
          f"rms {errors.pow(2).mean().sqrt():.3f} (bound {rms_bound:.3f})")
    assert errors.max() <= tolerance
    assert errors.pow(2).mean().sqrt() <= rms_bound


def test_bf16_greedy_token_is_the_references_where_its_margin_is_decisive(case) -> None:
    arch, path, tokens, reference, simulated = case
    tolerance, _ = bounds(reference, simulated)
    top2 = reference.topk(2, dim=-1)
    decisive = (top2.values[..., 0] - top2.values[..., 1]) > 2 * tolerance
    print(f"\n{arch}: {int(decisive.sum())} decisive positions of {decisive.numel()}")
    assert decisive.sum() >= MIN_DECISIVE, f"{arch}: too few decisive positions ({int(decisive.sum())}) for a test"
    ours = our_logits(path, "bfloat16", tokens).argmax(-1)
    assert torch.equal(ours[decisive], top2.indices[..., 0][decisive])


def test_float32_logits_stay_at_float32_accuracy(case) -> None:
    """The same harness in float32: far inside the bfloat16 tolerance, so the comparison itself is sound."""
    arch, path, tokens, reference, simulated = case
    tolerance, _ = bounds(reference, simulated)
    assert max_errors(our_logits(path, "float32", tokens), reference).max() < tolerance / 100


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_served_first_token_is_the_references_where_decisive(case, dtype) -> None:
    """Through the engine (scheduler, runner, sampler): each request's first greedy token."""
    arch, path, tokens, reference, simulated = case
    tolerance, _ = bounds(reference, simulated)
    llm = LLM(str(path), dtype=dtype, block_size=BLOCK_SIZE, num_kv_blocks=64)
    # each decisive position is one request, the prompt ending there, so it predicts the first token
    top2 = reference.topk(2, dim=-1)
    decisive = ((top2.values[..., 0] - top2.values[..., 1]) > 2 * tolerance).nonzero().tolist()
    assert len(decisive) >= MIN_DECISIVE, f"{arch}: too few decisive positions ({len(decisive)})"
    outs = llm.generate([{"prompt_token_ids": tokens[seq][:pos + 1]} for seq, pos in decisive],
                        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    for (seq, pos), out in zip(decisive, outs):
        assert out.outputs[0].token_ids == [int(top2.indices[seq, pos, 0])], f"{arch} {dtype}: {seq}, {pos}"
    assert llm.stats().blocks_in_use == 0
