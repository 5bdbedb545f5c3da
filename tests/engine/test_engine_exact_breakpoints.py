"""Token-exact breakpoints through the engine: a hit covers the prefix to the token, and what is
generated equals a run with prefix caching off."""
from __future__ import annotations

import random

import pytest

from prefixserve import EngineConfig, LLMEngine, SamplingParams
from prefixserve.engine import CachePin

BS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def run(engine: LLMEngine, rid: str, prompt: list[int], pins=(), write_limit=None, params=GREEDY):
    engine.add_request(rid, {"prompt_token_ids": prompt}, params, cache_pins=pins,
                       cache_write_limit=write_limit)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    return outs[rid]


def make_engine(caching: bool = True) -> LLMEngine:
    return LLMEngine(EngineConfig(model="random:qwen3-tiny", block_size=BS, num_kv_blocks=64,
                                  enable_prefix_caching=caching, max_num_batched_tokens=32))


@pytest.fixture(scope="module")
def engines():
    return make_engine(True), make_engine(False)


@pytest.mark.parametrize("t", [1, 7, 15, 17, 33, 46, 59, 60])   # 60: the whole prompt
def test_a_hit_at_an_exact_breakpoint_covers_it_to_the_token(engines, t):
    on, off = engines
    on.reset_prefix_cache()
    rng = random.Random(t)
    prompt = [rng.randrange(10, 4000) for _ in range(60)]
    follow = prompt[:t] + [rng.randrange(10, 4000) for _ in range(9)]
    pin = [CachePin(t, ttl_s=300.0, exact=True)]
    first = run(on, f"a{t}", prompt, pin)
    second = run(on, f"b{t}", follow, [CachePin(t, ttl_s=300.0, exact=True)])
    assert first.pins[0].pinned_tokens == t and first.pins[0].error is None
    assert second.num_cached_tokens == t
    for rid, p, out in ((f"a{t}", prompt, first), (f"b{t}", follow, second)):
        assert out.outputs[0].token_ids == run(off, rid, p).outputs[0].token_ids
    on.kv.check_integrity()


def test_sampled_forks_after_a_partial_hit_match_caching_off(engines):
    on, off = engines
    rng = random.Random(99)
    prompt = [rng.randrange(10, 4000) for _ in range(41)]
    run(on, "fa", prompt, [CachePin(37, ttl_s=300.0, exact=True)])
    params = SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=6, ignore_eos=True)
    follow = prompt[:37] + [11, 12, 13]
    hit = run(on, "fb", follow, [CachePin(37, ttl_s=300.0, exact=True)], params=params)
    assert hit.num_cached_tokens == 37
    cold = run(off, "fb", follow, params=params)
    assert [c.token_ids for c in hit.outputs] == [c.token_ids for c in cold.outputs]
    on.kv.check_integrity()
    assert on.stats().blocks_in_use == len({b for p in on.kv.pins() for b in p.block_ids})


def test_a_write_limit_keeps_the_rest_of_the_prompt_out_of_the_cache():
    engine = make_engine()
    rng = random.Random(5)
    prompt = [rng.randrange(10, 4000) for _ in range(80)]
    run(engine, "a", prompt, [CachePin(20, exact=True)], write_limit=20)
    # the mark's prefix is found to the token; the 60 tokens after it were never cached
    assert run(engine, "b", prompt + [9], [CachePin(20, exact=True)]).num_cached_tokens == 20
    assert run(engine, "c", prompt[:20] + [8] * 30).num_cached_tokens == 16
