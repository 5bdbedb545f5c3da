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

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from checkpoint_factory import VOCAB_SIZE
from prefixserve import LLM, SamplingParams
from prefixserve.model.attention.metadata import AttentionMetadata
from prefixserve.model.kv_layout import kv_cache_shape
from prefixserve.model.loader import load_model

BLOCK_SIZE = 16
SHARED = 64            # leading tokens (4 blocks) the three sequences share
PREFILL = 80           # tokens each sequence has before decoding starts
TOTAL = 112            # tokens each sequence ends with: 32 decode steps
NUM_SEQS = 3
TOLERANCE_FACTOR = 2.0
RMS_FACTOR = 1.5
# Random weights give small top-2 margins (median ~0.2 here against errors of ~0.25), so only a few
# percent of positions are decisive at bfloat16's tolerance: a handful per checkpoint.
MIN_DECISIVE = 4


def _to_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(t.dtype)


def _round_args(module, args):
    return tuple(_to_bf16(a) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def _round_output(module, args, output):
    return _to_bf16(output) if torch.is_tensor(output) else output


def hf_model(path: Path, dtype: torch.dtype, *, simulate_bf16: bool = False, device: str = "cpu"):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval().to(device)
    if simulate_bf16:
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(_to_bf16(param))
        for module in model.modules():
            kind = type(module).__name__
            if isinstance(module, torch.nn.Linear) or kind.endswith("RMSNorm") or kind.endswith("DecoderLayer"):
                module.register_forward_pre_hook(_round_args)
                module.register_forward_hook(_round_output)
    return model


def hf_logits(model, tokens: list[list[int]]) -> torch.Tensor:
    """[NUM_SEQS, TOTAL, vocab], float64 on the host, from a model on any device"""
    with torch.no_grad():
        return model(torch.tensor(tokens, device=model.device)).logits.double().cpu()


def references(path: Path, tokens: list[list[int]], device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """HF's float64 logits, and with bfloat16 rounding simulated (the tolerance's measure), on `device`."""
    return (hf_logits(hf_model(path, torch.float64, device=device), tokens),
            hf_logits(hf_model(path, torch.float64, simulate_bf16=True, device=device), tokens))


def sequences(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, VOCAB_SIZE, (SHARED,), generator=gen).tolist()
    return [shared + torch.randint(0, VOCAB_SIZE, (TOTAL - SHARED,), generator=gen).tolist()
            for _ in range(NUM_SEQS)]


def our_logits(path: Path, dtype: str, tokens: list[list[int]], device: str = "cpu") -> torch.Tensor:
    """Every position's logits [NUM_SEQS, TOTAL, vocab] (float64, on the host) from our model over a paged
    pool on `device`."""
    loaded = load_model(path, dtype=dtype, device=device)
    config = loaded.config
    per_seq = -(-TOTAL // BLOCK_SIZE)
    shared_blocks = SHARED // BLOCK_SIZE
    # sequence 0 owns the shared blocks; the others point at them, then take their own blocks,
    # numbered downwards so no table is a contiguous range
    num_blocks = shared_blocks + NUM_SEQS * (per_seq - shared_blocks)
    free = list(range(num_blocks - 1, shared_blocks - 1, -1))
    tables = [list(range(shared_blocks)) + [free.pop(0) for _ in range(per_seq - shared_blocks)]
              for _ in range(NUM_SEQS)]
    caches = [torch.zeros(kv_cache_shape(config, num_blocks, BLOCK_SIZE), dtype=loaded.model.embed_tokens.dtype,
                          device=device) for _ in range(config.num_hidden_layers)]
    out = torch.empty(NUM_SEQS, TOTAL, config.vocab_size, dtype=torch.float64)

    def step(plan: list[tuple[int, int, int]]) -> None:  # (sequence, first new position, new tokens)
        ids, positions = [], []
        for seq, start, count in plan:
            ids += tokens[seq][start:start + count]
            positions += range(start, start + count)
        meta = AttentionMetadata.build([c for _, _, c in plan], [s + c for _, s, c in plan],
                                       [tables[seq] for seq, _, _ in plan], BLOCK_SIZE, device=device)
        with torch.inference_mode():
            hidden = loaded.model(torch.tensor(ids, device=device), torch.tensor(positions, device=device), caches,
                                  meta)
            logits = loaded.model.compute_logits(hidden).double().cpu()
        row = 0
        for seq, start, count in plan:
            out[seq, start:start + count] = logits[row:row + count]
            row += count

    step([(0, 0, PREFILL)])
    # the others' shared prefix is cached: only their own tokens are computed, over sequence 0's blocks
    step([(seq, SHARED, PREFILL - SHARED) for seq in range(1, NUM_SEQS)])
    for position in range(PREFILL, TOTAL):
        step([(seq, position, 1) for seq in range(NUM_SEQS)])
    # positions sequences 1.. did not compute themselves are sequence 0's (the same tokens)
    out[1:, :SHARED] = out[0, :SHARED]
    return out


@pytest.fixture(scope="module", params=["qwen3", "qwen2", "llama"])
def case(request, tiny_checkpoint):
    path = tiny_checkpoint(request.param)
    tokens = sequences(seed=11)
    return request.param, path, tokens, *references(path, tokens)


def _errors(logits: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    return (logits - reference).abs().amax(-1)  # per position


def _bounds(reference: torch.Tensor, simulated: torch.Tensor) -> tuple[float, float]:
    e_sim = _errors(simulated, reference)
    assert e_sim.max() > 0, "the rounding simulation changed nothing: the tolerance would be zero"
    return TOLERANCE_FACTOR * e_sim.max().item(), RMS_FACTOR * e_sim.pow(2).mean().sqrt().item()


@pytest.mark.parametrize("implementation", ["prefixserve", "transformers"])
def test_bf16_logits_within_rounding_tolerance_of_float64(case, implementation) -> None:
    arch, path, tokens, reference, simulated = case
    tolerance, rms_bound = _bounds(reference, simulated)
    logits = (our_logits(path, "bfloat16", tokens) if implementation == "prefixserve"
              else hf_logits(hf_model(path, torch.bfloat16), tokens))
    errors = _errors(logits, reference)
    print(f"\n{arch} {implementation}: max {errors.max():.3f} (tolerance {tolerance:.3f}), "
          f"rms {errors.pow(2).mean().sqrt():.3f} (bound {rms_bound:.3f})")
    assert errors.max() <= tolerance
    assert errors.pow(2).mean().sqrt() <= rms_bound


def test_bf16_greedy_token_is_the_references_where_its_margin_is_decisive(case) -> None:
    arch, path, tokens, reference, simulated = case
    tolerance, _ = _bounds(reference, simulated)
    top2 = reference.topk(2, dim=-1)
    decisive = (top2.values[..., 0] - top2.values[..., 1]) > 2 * tolerance
    print(f"\n{arch}: {int(decisive.sum())} decisive positions of {decisive.numel()}")
    assert decisive.sum() >= MIN_DECISIVE, f"{arch}: too few decisive positions ({int(decisive.sum())}) for a test"
    ours = our_logits(path, "bfloat16", tokens).argmax(-1)
    assert torch.equal(ours[decisive], top2.indices[..., 0][decisive])


def test_float32_logits_stay_at_float32_accuracy(case) -> None:
    """The same harness in float32: far inside the bfloat16 tolerance, so the comparison itself is sound."""
    arch, path, tokens, reference, simulated = case
    tolerance, _ = _bounds(reference, simulated)
    assert _errors(our_logits(path, "float32", tokens), reference).max() < tolerance / 100


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_served_first_token_is_the_references_where_decisive(case, dtype) -> None:
    """Through the engine (scheduler, runner, sampler): each request's first greedy token."""
    arch, path, tokens, reference, simulated = case
    tolerance, _ = _bounds(reference, simulated)
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
