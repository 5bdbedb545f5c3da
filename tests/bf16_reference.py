"""The bfloat16 references of tests/model/test_bf16_correctness.py (whose docstring explains the
tolerance), shared with tests/platforms/test_cuda_device.py, which holds a CUDA device to them:
HF transformers in float64 (and with bfloat16 rounding simulated) on a tiny checkpoint, our model's
logits over a paged pool exactly as served, and the bounds the rounding simulation sets."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from checkpoint_factory import VOCAB_SIZE
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


def max_errors(logits: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    return (logits - reference).abs().amax(-1)  # per position


def bounds(reference: torch.Tensor, simulated: torch.Tensor) -> tuple[float, float]:
    e_sim = max_errors(simulated, reference)
    assert e_sim.max() > 0, "the rounding simulation changed nothing: the tolerance would be zero"
    return TOLERANCE_FACTOR * e_sim.max().item(), RMS_FACTOR * e_sim.pow(2).mean().sqrt().item()
