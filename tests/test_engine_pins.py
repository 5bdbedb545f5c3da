"""Explicit pins keep a prefix through memory pressure that LRU alone would not survive."""
from __future__ import annotations

import random

from prefixserve import EngineConfig, LLMEngine, SamplingParams
from prefixserve.engine import CachePin

BS = 16
PARAMS = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run(engine: LLMEngine, rid: str, prompt: list[int], pins=()) -> object:
    engine.add_request(rid, {"prompt_token_ids": prompt}, PARAMS, cache_pins=pins)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out


def make_engine(clock, num_blocks=40, fraction=0.5) -> LLMEngine:
    return LLMEngine(EngineConfig(model="random:qwen3-tiny", block_size=BS, num_kv_blocks=num_blocks,
                                  max_pinned_fraction=fraction), clock=clock)


def flood(engine: LLMEngine, rng: random.Random, n: int = 12) -> None:
    for i in range(n):
        run(engine, f"flood-{i}", [rng.randrange(10, 4000) for _ in range(200)])


def test_pinned_document_survives_a_flood_and_unpinned_does_not():
    rng = random.Random(0)
    doc = [rng.randrange(10, 4000) for _ in range(300)]
    for pinned in (True, False):
        clock = FakeClock()
        engine = make_engine(clock)
        first = run(engine, "doc-1", doc, pins=[CachePin(len(doc), ttl_s=300.0)] if pinned else [])
        if pinned:
            assert first.pins[0].pinned_tokens == 288 and first.pins[0].error is None
        flood(engine, rng)
        again = run(engine, "doc-2", doc + [5])
        expected = (len(doc) // BS) * BS if pinned else 0
        assert again.num_cached_tokens == expected, (pinned, again.num_cached_tokens)
        assert engine.stats().evictions > 0
        engine.kv.check_integrity()


def test_pin_expires_after_its_ttl_and_becomes_evictable():
    rng = random.Random(1)
    doc = [rng.randrange(10, 4000) for _ in range(300)]
    clock = FakeClock()
    engine = make_engine(clock)
    run(engine, "doc-1", doc, pins=[CachePin(len(doc), ttl_s=5.0)])
    assert engine.stats().blocks_pinned == 18
    clock.now += 6.0
    flood(engine, rng)
    assert engine.stats().blocks_pinned == 0
    again = run(engine, "doc-2", doc + [5])
    assert again.num_cached_tokens == 0
    assert engine.stats().blocks_in_use == 0


def test_pin_beyond_the_cap_is_reported_not_dropped_silently():
    rng = random.Random(2)
    clock = FakeClock()
    engine = make_engine(clock, num_blocks=40, fraction=0.25)  # at most 10 pinned blocks
    doc = [rng.randrange(10, 4000) for _ in range(300)]
    out = run(engine, "doc", doc, pins=[CachePin(len(doc), ttl_s=60.0)])
    assert out.pins[0].pinned_tokens == 0
    assert out.pins[0].error and "pin" in out.pins[0].error.lower()
    assert engine.stats().blocks_pinned == 0
