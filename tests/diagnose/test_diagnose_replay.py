"""Replay through prefixserve.kv: brute-force hits without eviction, and the engine's own
num_cached_tokens for the same requests in the same order with the same pool."""
from __future__ import annotations

import random

import pytest

from prefixserve import LLM, SamplingParams
from prefixserve.diagnose import load_renderer, read_log
from prefixserve.diagnose.lint import to_replay
from prefixserve.diagnose.replay import ReplayConfig, ReplayRequest, replay, replay_unbounded
from diagnose_logs import RULE_LOGS, clean_log, write_log

BS = 16


def brute_hits(requests):
    """Without eviction: the block-aligned longest prefix shared with an earlier prompt of the
    same salt, never counting the last token."""
    out = []
    for i, r in enumerate(requests):
        best = 0
        for e in requests[:i]:
            if e.cache_salt != r.cache_salt:
                continue
            n = 0
            while n < min(len(e.token_ids), len(r.token_ids)) and e.token_ids[n] == r.token_ids[n]:
                n += 1
            best = max(best, n)
        out.append(min(best, len(r.token_ids) - 1) // BS * BS)
    return out


def random_requests(seed: int, n: int = 40):
    rng = random.Random(seed)
    bases = [[rng.randrange(1000) for _ in range(rng.randrange(10, 90))] for _ in range(5)]
    return [ReplayRequest(f"r{i}", rng.choice(bases)[:rng.randrange(0, 90)]
                          + [rng.randrange(1000) for _ in range(rng.randrange(1, 30))],
                          rng.choice([None, "a"])) for i in range(n)]


@pytest.mark.parametrize("seed", range(3))
def test_unbounded_replay_equals_brute_force(seed):
    requests = random_requests(seed)
    result = replay_unbounded(requests, BS)
    assert result.hits == brute_hits(requests)
    assert result.evictions == 0
    assert result.prompt_tokens == sum(len(r.token_ids) for r in requests)


def test_small_pool_evicts_and_never_beats_unbounded():
    requests = random_requests(7)
    small = replay(requests, ReplayConfig(num_blocks=8, block_size=BS))
    full = replay_unbounded(requests, BS)
    assert small.evictions > 0
    assert all(s <= f for s, f in zip(small.hits, full.hits))
    assert small.hit_tokens < full.hit_tokens


def test_too_large_requests_are_reported():
    result = replay([ReplayRequest("big", list(range(100)))], ReplayConfig(num_blocks=2, block_size=BS))
    assert result.too_large == ["big"] and result.hits == [0]


def test_output_tokens_are_counted_and_cached():
    prompt = list(range(40))
    reply = list(range(100, 140))
    first = ReplayRequest("a", prompt, output_token_ids=reply)
    # The next turn carries the reply in its prompt: the reply's blocks were registered.
    second = ReplayRequest("b", prompt + reply + [7, 8, 9])
    result = replay_unbounded([first, second], BS)
    assert result.output_tokens == 40
    assert result.hits == [0, (40 + 39) // BS * BS]


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="eviction_policy"):
        replay([ReplayRequest("a", [1])], ReplayConfig(num_blocks=4, eviction_policy="fifo"))


@pytest.mark.parametrize("pool", ["tight", "roomy"])
def test_replay_hits_equal_engine_num_cached_tokens(tmp_path, pool):
    records = []
    for name in ("tool-order", "history-rewrite", "volatile-prefix"):
        records += RULE_LOGS[name](seed=3)
    records += clean_log(seed=3)
    for i, r in enumerate(records):
        r["request_id"] = f"q{i}"
        r["tenant"] = "a" if i % 3 else "b"
    renderer = load_renderer("random:qwen3-tiny")
    rendered = [renderer.render(r) for r in read_log(write_log(tmp_path / "log.jsonl", records))]
    requests = to_replay(rendered)
    # "tight": room for the largest request (+ its one sampled token) and a little more.
    largest = max(-(-(len(r.token_ids) + 1) // BS) for r in requests)
    num_blocks = largest + 4 if pool == "tight" else 400
    result = replay(requests, ReplayConfig(num_blocks=num_blocks, block_size=BS))
    llm = LLM("random:qwen3-tiny", num_kv_blocks=num_blocks, block_size=BS)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    engine_hits = [llm.generate({"prompt_token_ids": list(r.token_ids), "cache_salt": r.cache_salt},
                                params)[0].num_cached_tokens for r in requests]
    assert result.hits == engine_hits
    assert sum(engine_hits) > 0
    assert result.evictions == llm.stats().evictions
    if pool == "tight":
        assert result.evictions > 0
