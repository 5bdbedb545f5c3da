"""Our forward over the paged pool against HF transformers on the same checkpoint (float32).

A batch of sequences of different lengths (one shorter than a block, one just
over a block, one over two blocks) is prefilled into shuffled, non-contiguous
physical blocks; a second step mixes a multi-token chunk with single-token
decodes that read the first step's K/V back from the pool. HF runs each full
sequence on its own, with eager attention and no cache.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from checkpoint_factory import VOCAB_SIZE as VOCAB, build_tiny_model, write_tiny_checkpoint
from prefixserve.model.attention.metadata import AttentionMetadata
from prefixserve.model.kv_layout import kv_cache_shape
from prefixserve.model.layers import rope_inverse_frequencies
from prefixserve.model.loader import load_model

BLOCK_SIZE = 16
NUM_BLOCKS = 24
PROMPT_LENS = [5, 17, 40]
# second step: sequence 0 continues with a 14-token chunk (crossing into its 2nd block),
# sequences 1 and 2 decode one token each; listed out of order on purpose
SECOND_STEP = [(2, 1), (0, 14), (1, 1)]
TOLERANCE = 1e-4


class PagedSequences:
    """Token ids and block tables of a few sequences, blocks taken from a shuffled free list."""

    def __init__(self, lengths: list[int], seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.free_blocks = torch.randperm(NUM_BLOCKS, generator=self.generator).tolist()
        self.tokens = [self._random_ids(n) for n in lengths]
        self.tables: list[list[int]] = [[] for _ in lengths]
        self.computed = [0] * len(lengths)

    def _random_ids(self, n: int) -> list[int]:
        return torch.randint(0, VOCAB, (n,), generator=self.generator).tolist()

    def step(self, plan: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Schedules (sequence, new token count) pairs; tokens past the prompt are random ids."""
        ids, positions, query_lens, seq_lens, tables = [], [], [], [], []
        for seq, count in plan:
            done = self.computed[seq]
            missing = done + count - len(self.tokens[seq])
            if missing > 0:
                self.tokens[seq].extend(self._random_ids(missing))
            while len(self.tables[seq]) * BLOCK_SIZE < done + count:
                self.tables[seq].append(self.free_blocks.pop())
            ids.extend(self.tokens[seq][done:done + count])
            positions.extend(range(done, done + count))
            query_lens.append(count)
            seq_lens.append(done + count)
            tables.append(list(self.tables[seq]))
            self.computed[seq] = done + count
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE)
        return torch.tensor(ids), torch.tensor(positions), meta


def _hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def max_error_against_transformers(path: Path) -> float:
    """Runs both steps through our model and HF; asserts argmax agreement; returns the max abs error."""
    loaded = load_model(path, dtype=torch.float32)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    hf_model.eval()
    config = loaded.config
    caches = [torch.zeros(kv_cache_shape(config, NUM_BLOCKS, BLOCK_SIZE)) for _ in range(config.num_hidden_layers)]
    assert config.vocab_size == VOCAB
    seqs = PagedSequences(PROMPT_LENS, seed=7)

    worst = 0.0
    plans = [[(i, n) for i, n in enumerate(PROMPT_LENS)], SECOND_STEP]
    for plan in plans:
        ids, positions, meta = seqs.step(plan)
        with torch.inference_mode():
            logits = loaded.model.compute_logits(loaded.model(ids, positions, caches, meta))
        start = 0
        for seq, count in plan:
            done = seqs.computed[seq]
            expected = _hf_logits(hf_model, seqs.tokens[seq])[done - count:done]
            got = logits[start:start + count]
            # the checkpoint's logits must be decisive for an argmax comparison to mean anything
            top2 = expected.topk(2, dim=-1).values
            assert (top2[:, 0] - top2[:, 1]).median() > 100 * TOLERANCE
            worst = max(worst, (got - expected).abs().max().item())
            assert torch.equal(got.argmax(-1), expected.argmax(-1)), f"{path.name}: argmax differs for seq {seq}"
            start += count
    non_contiguous = [t for t in seqs.tables if len(t) > 1 and t != list(range(t[0], t[0] + len(t)))]
    assert non_contiguous, "the test layout should scatter sequences over non-adjacent blocks"
    return worst


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_logits_match_transformers(arch: str, tiny_checkpoint, record_property) -> None:
    worst = max_error_against_transformers(tiny_checkpoint(arch))
    record_property(f"max_abs_logit_error_{arch}", worst)
    print(f"\n{arch}: max abs logit error vs transformers = {worst:.3e}")
    assert worst < TOLERANCE


def test_output_projection_bias_matches_transformers(tmp_path: Path) -> None:
    """Llama's attention_bias puts a bias on o_proj too (Qwen2's q/k/v-only bias is covered above)."""
    path = write_tiny_checkpoint(tmp_path / "llama_bias", "llama", attention_bias=True)
    assert max_error_against_transformers(path) < TOLERANCE


def test_llama3_inverse_frequencies_match_transformers() -> None:
    hf_config = build_tiny_model("llama").config
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    scaling = dict(hf_config.rope_parameters)
    theta = scaling.pop("rope_theta")
    ours = rope_inverse_frequencies(hf_config.head_dim, theta, scaling)
    unscaled = rope_inverse_frequencies(hf_config.head_dim, theta, None)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0)
    # all three bands occur: unchanged, blended and fully stretched frequencies
    ratios = (unscaled / ours).tolist()
    assert ratios[0] == pytest.approx(1.0)
    assert ratios[-1] == pytest.approx(scaling["factor"])
    assert any(1.0 + 1e-3 < r < scaling["factor"] - 1e-3 for r in ratios)
