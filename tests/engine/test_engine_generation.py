"""End-to-end generations against an independent oracle: HF transformers, greedy, no cache.

The oracle recomputes the whole sequence every step with HF's model on the
same checkpoint files; our engine runs paged, batched, chunked and cached.
"""
from __future__ import annotations

import random

import pytest
import torch
import transformers

from prefixserve import LLM, SamplingParams


def hf_greedy(path, prompt: list[int], max_new: int) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt):]


def random_prompts(n: int, lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_greedy_generation_matches_hf(tiny_checkpoints, arch):
    path = tiny_checkpoints[arch]
    # float32 as the oracle: exact greedy equality over 12 tokens holds only at the same precision
    llm = LLM(str(path), dtype="float32", block_size=16, num_kv_blocks=64, max_num_batched_tokens=64)
    prompts = random_prompts(4, [5, 17, 40, 33], vocab=1000, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 12)
    assert llm.stats().blocks_in_use == 0
    llm.engine.kv.check_integrity()
