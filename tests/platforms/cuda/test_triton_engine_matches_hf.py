"""The whole engine with its attention on the Triton kernels (float32; under Triton's interpreter without a
GPU), held to HF transformers' greedy tokens (the whole sequence recomputed each step, no cache) with
prefix-cache hits, chunked prefills over cached contexts and decodes sharing a cached prefix (the cascade).
"""
from __future__ import annotations

import random

import torch
import transformers

from kernel_device import KERNEL_DEVICE
from prefix_caching_oracle import BS, expected_cached
from prefixserve import LLM, SamplingParams
from prefixserve.platforms.cuda.attention import TritonPagedAttention

MAX_NEW = 5


def hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(torch.tensor([ids], device=KERNEL_DEVICE)).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt):]


def test_triton_attention_engine_matches_hf_with_prefix_hits(tiny_checkpoints):
    # qwen3: four query heads a KV head, head_dim 16 (the kernels' own tests cover the other shapes)
    path = tiny_checkpoints["qwen3"]
    rng = random.Random(5)
    prefix = [rng.randrange(10, 4000) for _ in range(2 * BS + 5)]
    # the first runs alone and fills the cache; the others arrive together, hit its blocks, and decode
    # side by side over them
    prompts = [prefix + [rng.randrange(10, 4000) for _ in range(n)] for n in (3, 7, 18)]
    llm = LLM(str(path), dtype="float32", device=KERNEL_DEVICE, attention_backend="triton", block_size=BS,
              num_kv_blocks=64, max_num_batched_tokens=24)
    assert isinstance(llm.engine.loaded.model.attention_backend, TritonPagedAttention)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": prompts[0]}, params)[0]
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params)

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(KERNEL_DEVICE).eval()
    history = [prompts[0] + first.outputs[0].token_ids]
    for prompt, out in zip(prompts, [first, *rest]):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, MAX_NEW)
    for prompt, out in zip(prompts[1:], rest):
        assert out.num_cached_tokens == expected_cached(history, prompt) > 0
    assert llm.stats().blocks_in_use == 0
    llm.engine.kv.check_integrity()
