"""Prefix caching changes nothing a client sees, in every dtype: with caching on, a request whose
prefix comes from the pool (computed by another request, in another batch) gets exactly the
tokens and log-probabilities it gets with caching off, where every token is computed afresh.

The tokens must be equal exactly. Where the model's weights are packed (native/packed_gemm.c: bfloat16
on a CPU with avx512_bf16, float32 on a CPU with AVX-512), so are the log-probabilities, bit for bit:
every product runs through one kernel whose row results do not depend on the batch, and decode
attention carries a shared run's softmax state into each sequence's own blocks instead of merging two
finished halves. Elsewhere they are equal up to the last bits only: a row computed in a batch of
another size may round differently (oneDNN and MKL pick kernels by shape), measured at ~5e-7 in
float32 on this test.
"""
from __future__ import annotations

import random

import pytest

from prefixserve import LLM, SamplingParams
from prefixserve.platforms.cpu.native import packed_gemm
from prefixserve.platforms.cpu.native.build import enabled

PREFIX_LEN = 56  # 3.5 blocks: the shared run ends inside a block
SUFFIX_LENS = [3, 9, 16, 21, 30, 1]
# a few units in the last place of the dtype a step computes in
LOGPROB_RTOL = {"float32": 1e-5, "bfloat16": 5e-2, "float16": 1e-2}
# the dtypes in which every product and decode attention are batch-invariant here (see the module docstring)
EXACT_DTYPES = {str(dtype).removeprefix("torch.") for dtype in
                (packed_gemm.default_kernel().dtypes if enabled() and packed_gemm.default_kernel() else ())}


def prompts(seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(10, vocab) for _ in range(PREFIX_LEN)]
    return [prefix + [rng.randrange(10, vocab) for _ in range(n)] for n in SUFFIX_LENS]


def serve(path: str, dtype: str, caching: bool, batches: list[list[list[int]]]):
    llm = LLM(path, dtype=dtype, enable_prefix_caching=caching, block_size=16, num_kv_blocks=128,
              max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    results = []
    for batch in batches:
        for out in llm.generate([{"prompt_token_ids": p} for p in batch], params):
            results.append((out.outputs[0].token_ids, out.outputs[0].logprobs))
    stats = llm.stats()
    assert stats.blocks_in_use == 0 and stats.dtype == dtype
    llm.engine.kv.check_integrity()
    return results, stats


def assert_same_outputs(on: list, off: list, dtype: str) -> None:
    """Equal tokens; the sampled tokens' log-probabilities equal bit for bit where every product is
    batch-invariant (weights packed), elsewhere up to the last bits (a row computed in a batch of another
    size may round differently)."""
    for i, ((tokens_on, logprobs_on), (tokens_off, logprobs_off)) in enumerate(zip(on, off)):
        assert tokens_on == tokens_off, f"request {i}"
        for (lp_on, _), (lp_off, _) in zip(logprobs_on, logprobs_off):
            if dtype in EXACT_DTYPES:
                assert lp_on == lp_off, f"request {i}"
            else:
                assert lp_on == pytest.approx(lp_off, rel=LOGPROB_RTOL[dtype], abs=LOGPROB_RTOL[dtype])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_cached_prefix_gives_identical_outputs(tiny_checkpoint, arch: str, dtype: str) -> None:
    ps = prompts(seed=5, vocab=1000)
    # the first request alone fills the cache; the rest run together (prefill chunks beside decodes)
    # and, with caching on, start from its blocks
    batches = [ps[:1], ps[1:]]
    path = str(tiny_checkpoint(arch))
    on, on_stats = serve(path, dtype, True, batches)
    off, off_stats = serve(path, dtype, False, batches)
    assert on_stats.cached_prompt_tokens >= (len(ps) - 1) * (PREFIX_LEN // 16) * 16
    assert off_stats.cached_prompt_tokens == 0
    assert_same_outputs(on, off, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_token_remainders_and_reused_decoded_kv_give_identical_outputs(tiny_checkpoint, dtype: str) -> None:
    """The two ways a token's attention runs in another kernel with caching on than off: a prompt
    whose uncached remainder is a single token (decode kernel on; a prefill chunk off), and a next
    turn whose prompt holds the previous answer (its K/V written by decode steps on; recomputed in a
    prefill off). Both kernels give a token the same bits, so the outputs are the same."""
    rng = random.Random(9)
    first = [rng.randrange(10, 1000) for _ in range(64)]          # 4 whole blocks
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)

    def conversation(caching: bool):
        llm = LLM(str(tiny_checkpoint("qwen3")), dtype=dtype, enable_prefix_caching=caching, block_size=16,
                  num_kv_blocks=128)
        turn1 = llm.generate({"prompt_token_ids": first}, params)[0]
        answer = turn1.outputs[0].token_ids
        one_more = llm.generate({"prompt_token_ids": first + [7]}, params)[0]
        turn2 = llm.generate({"prompt_token_ids": first + answer + [11, 12, 13]}, params)[0]
        outs = [turn1, one_more, turn2]
        return ([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], [o.num_cached_tokens for o in outs])

    on, cached_on = conversation(True)
    off, cached_off = conversation(False)
    # the one-token remainder and the reused answer blocks (64 + 24 tokens: 5 whole blocks)
    assert cached_on == [0, 64, 80] and cached_off == [0, 0, 0]
    assert_same_outputs(on, off, dtype)
