"""Prefix caching must change what is computed, never what is generated."""
from __future__ import annotations

import random

import pytest

from prefix_caching_oracle import BS, expected_cached, shared_prefix_prompts, tokens
from prefixserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_path(tiny_checkpoints):
    return str(tiny_checkpoints["qwen3"])


def make_llm(path, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 128)
    return LLM(path, block_size=BS, **kw)


def run_sequentially(llm: LLM, prompts, params=GREEDY):
    return [llm.generate({"prompt_token_ids": p}, params)[0] for p in prompts]


@pytest.mark.parametrize("prefix_len", [1, 15, 16, 17, 31, 32, 33, 48, 50])
def test_caching_on_equals_off_and_counts_cached_tokens(tiny_path, prefix_len):
    prompts = shared_prefix_prompts(prefix_len, seed=prefix_len)
    on = make_llm(tiny_path, enable_prefix_caching=True)
    off = make_llm(tiny_path, enable_prefix_caching=False)
    outs_on = run_sequentially(on, prompts)
    outs_off = run_sequentially(off, prompts)
    assert [o.outputs[0].token_ids for o in outs_on] == [o.outputs[0].token_ids for o in outs_off]
    history: list[list[int]] = []
    for prompt, out in zip(prompts, outs_on):
        assert out.num_cached_tokens == expected_cached(history, prompt)
        history.append(prompt + out.outputs[0].token_ids)
    assert all(o.num_cached_tokens == 0 for o in outs_off)
    for llm in (on, off):
        assert llm.stats().blocks_in_use == 0
        llm.engine.kv.check_integrity()


def test_fully_cached_prompt_recomputes_one_block(tiny_path):
    rng = random.Random(3)
    prompt = tokens(rng, 2 * BS)
    llm = make_llm(tiny_path)
    first, second = run_sequentially(llm, [prompt, prompt])
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == BS  # the last block holds the last token: recomputed
    assert first.outputs[0].token_ids == second.outputs[0].token_ids


def test_salts_never_share(tiny_path):
    rng = random.Random(4)
    prompt = tokens(rng, 70)
    llm = make_llm(tiny_path)
    a = llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-a"}, GREEDY)[0]
    b = llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-b"}, GREEDY)[0]
    a2 = llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-a"}, GREEDY)[0]
    plain = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]
    assert (a.num_cached_tokens, b.num_cached_tokens, plain.num_cached_tokens) == (0, 0, 0)
    assert a2.num_cached_tokens == 64
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == plain.outputs[0].token_ids


def test_requests_arriving_together_compute_shared_prefix_once(tiny_path):
    rng = random.Random(5)
    prefix = tokens(rng, 100)
    prompts = [prefix + tokens(rng, 5 + i) for i in range(10)]
    llm = make_llm(tiny_path, max_num_batched_tokens=4096)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    shared = 100 // BS * BS
    stats = llm.stats()
    # The first request computes its whole prompt; the other nine only what follows the
    # shared full blocks, although all ten were scheduled in the same step.
    assert stats.computed_prompt_tokens == len(prompts[0]) + sum(len(p) - shared for p in prompts[1:])
    assert [o.num_cached_tokens for o in outs] == [0] + [shared] * 9
    ref = make_llm(tiny_path, enable_prefix_caching=False)
    ref_outs = ref.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref_outs]


def test_small_pool_preempts_and_keeps_outputs(tiny_path):
    rng = random.Random(6)
    prompts = [tokens(rng, 40 + 7 * i) for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    roomy = make_llm(tiny_path, num_kv_blocks=256)
    tight = make_llm(tiny_path, num_kv_blocks=12)
    want = roomy.generate([{"prompt_token_ids": p} for p in prompts], params)
    got = tight.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert tight.stats().preemptions > 0
    assert tight.stats().blocks_in_use == 0
    tight.engine.kv.check_integrity()


@pytest.mark.parametrize("budget", [1, 7, 16])
def test_chunked_prefill_with_tiny_budget_keeps_outputs(tiny_path, budget):
    rng = random.Random(7)
    prompts = [tokens(rng, n) for n in (3, 29, 45)]
    big = make_llm(tiny_path, max_num_batched_tokens=4096)
    small = make_llm(tiny_path, max_num_batched_tokens=budget)
    want = big.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    got = small.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert small.stats().steps > big.stats().steps


def test_abort_frees_every_block(tiny_path):
    rng = random.Random(8)
    llm = make_llm(tiny_path)
    engine = llm.engine
    for i in range(5):
        engine.add_request(f"r{i}", {"prompt_token_ids": tokens(rng, 30 + i)},
                           SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.stats().blocks_in_use > 0
    engine.abort_request([f"r{i}" for i in range(5)])
    assert engine.stats().blocks_in_use == 0
    assert not engine.has_unfinished_requests()
    engine.kv.check_integrity()


def test_a_failed_forward_leaves_no_unwritten_block_in_the_cache(tiny_path):
    rng = random.Random(9)
    prompt = tokens(rng, 70)
    llm = make_llm(tiny_path)
    engine = llm.engine
    engine.add_request("doomed", {"prompt_token_ids": prompt}, GREEDY)
    real = engine.runner.execute

    def broken(*args, **kwargs):
        raise RuntimeError("simulated device failure")
    engine.runner.execute = broken
    [out] = engine.step()
    engine.runner.execute = real
    # Alone in its step, so it is the culprit: ended with an error, not raised to the caller.
    assert out.finished and out.error and out.outputs[0].finish_reason == "abort"
    # The prompt's blocks were registered before the forward that never wrote them.
    assert not engine.has_unfinished_requests()
    stats = engine.stats()
    assert stats.blocks_in_use == 0 and stats.blocks_cached == 0
    engine.kv.check_integrity()
    again = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]
    assert again.num_cached_tokens == 0
    fresh = make_llm(tiny_path).generate({"prompt_token_ids": prompt}, GREEDY)[0]
    assert again.outputs[0].token_ids == fresh.outputs[0].token_ids
