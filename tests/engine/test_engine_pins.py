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


# ------------------------------------------------------------------ cached contents


def content(cid: str, tokens: list[int], name=None, owner=None):
    from prefixserve.engine import CachedContent
    return CachedContent(cid, name, tokens, None, 0, owner=owner)


def create(engine: LLMEngine, cid: str, tokens: list[int], name=None, ttl_s=60.0, owner=None):
    c = content(cid, tokens, name, owner)
    out = run(engine, f"prefill-{cid}", tokens, pins=[CachePin(len(tokens), ttl_s, content=c)])
    return c, out.pins[0]


def test_a_content_is_registered_in_the_call_that_pins_it_and_shared_pins_outlive_one_delete():
    import pytest

    from prefixserve.errors import NotFoundError
    rng = random.Random(3)
    doc = [rng.randrange(10, 4000) for _ in range(100)]
    engine = make_engine(FakeClock())
    a, ra = create(engine, "cc-a", doc, name="docs")
    b, rb = create(engine, "cc-b", doc)  # the same tokens: the same blocks, one pin
    assert ra.error is None and rb.error is None and ra.pin_id == rb.pin_id
    assert [c.id for c, _ in engine.cached_contents()] == ["cc-a", "cc-b"]
    assert engine.find_cached_content("docs")[0] is a
    engine.delete_cached_content("cc-a")
    # b still holds the shared pin: its blocks stay pinned and it is still found
    assert engine.stats().blocks_pinned == 100 // BS
    assert engine.find_cached_content("cc-b")[1].num_tokens == (100 // BS) * BS
    with pytest.raises(NotFoundError):
        engine.find_cached_content("docs")
    engine.delete_cached_content("cc-b")
    assert engine.stats().blocks_pinned == 0 and engine.cached_contents() == []
    engine.kv.check_integrity()


def test_a_taken_name_refuses_the_content_and_releases_only_its_own_new_pin():
    rng = random.Random(4)
    first_doc = [rng.randrange(10, 4000) for _ in range(64)]
    other_doc = [rng.randrange(10, 4000) for _ in range(64)]
    engine = make_engine(FakeClock())
    create(engine, "cc-1", first_doc, name="manual")
    _, refused = create(engine, "cc-2", other_doc, name="manual")
    assert refused.error and "manual" in refused.error
    assert [c.id for c, _ in engine.cached_contents()] == ["cc-1"]
    assert engine.stats().blocks_pinned == 64 // BS  # the refused content's pin is gone
    # the same name in another owner's scope is a different content
    _, other = create(engine, "cc-3", other_doc, name="manual", owner="tenant-b")
    assert other.error is None
    assert [c.id for c, _ in engine.cached_contents("tenant-b")] == ["cc-3"]
    assert [c.id for c, _ in engine.cached_contents()] == ["cc-1"]


def test_an_expired_content_is_gone_and_repin_sets_the_expiry_both_ways():
    import pytest

    from prefixserve.errors import NotFoundError
    rng = random.Random(5)
    doc = [rng.randrange(10, 4000) for _ in range(64)]
    clock = FakeClock()
    engine = make_engine(clock)
    create(engine, "cc-1", doc, ttl_s=100.0)
    _, pin = engine.repin_cached_content("cc-1", 10.0)
    assert pin.expires_at == clock.now + 10.0
    _, pin = engine.repin_cached_content("cc-1", 500.0)
    assert pin.expires_at == clock.now + 500.0
    clock.now += 501.0
    with pytest.raises(NotFoundError):
        engine.find_cached_content("cc-1")
    assert engine.cached_contents() == [] and engine.stats().blocks_pinned == 0


def make_tenant_engine(clock, max_contents: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model="random:qwen3-tiny", block_size=BS, num_kv_blocks=40,
                                  max_cached_contents_per_tenant=max_contents), clock=clock)


def create_for(engine: LLMEngine, cid: str, tokens: list[int], tenant: str, ttl_s=60.0):
    from prefixserve.engine import CachedContent
    c = CachedContent(cid, None, tokens, tenant, 0, owner=tenant, tenant=tenant)
    out = run(engine, f"prefill-{cid}", tokens, pins=[CachePin(len(tokens), ttl_s, content=c, tenant=tenant)])
    return out.pins[0]


def test_a_tenant_at_its_maximum_of_contents_is_refused_before_anything_is_pinned():
    # Identical contents share one pin, so only a count bounds what one tenant registers.
    rng = random.Random(6)
    doc, other = ([rng.randrange(10, 4000) for _ in range(64)] for _ in range(2))
    clock = FakeClock()
    engine = make_tenant_engine(clock, max_contents=3)
    assert all(create_for(engine, f"a{i}", doc, "acme").error is None for i in range(3))
    pinned = engine.stats().blocks_pinned
    for cid, tokens in (("a3", doc), ("a4", other)):
        refused = create_for(engine, cid, tokens, "acme")
        assert refused.error_code == "cached_content_limit" and refused.pin_id is None
    assert engine.stats().blocks_pinned == pinned          # the other document was not pinned
    assert [c.id for c, _ in engine.cached_contents("acme")] == ["a0", "a1", "a2"]
    assert create_for(engine, "z0", other, "zeta").error is None    # another tenant is not held back
    engine.delete_cached_content("a1", owner="acme")
    assert create_for(engine, "a5", doc, "acme").error is None
    # the shared pin's expiry takes all of acme's contents, and with them its count
    clock.now += 61.0
    assert engine.cached_contents("acme") == [] and engine.cached_contents("zeta") == []
    assert all(create_for(engine, f"b{i}", doc, "acme").error is None for i in range(3))
    engine.reset_prefix_cache()
    assert engine.cached_contents("acme") == [] and engine.stats().blocks_pinned == 0
    engine.kv.check_integrity()


def test_listing_contents_reads_their_pins_as_of_one_moment():
    # A pin expiring between reading the contents and reading their pins must not break the
    # listing: it sees the moment it expired pins at, and the next call sees the pin gone.
    class Scripted(FakeClock):
        reads: list = []

        def __call__(self) -> float:
            return self.reads.pop(0) if self.reads else self.now

    rng = random.Random(7)
    doc = [rng.randrange(10, 4000) for _ in range(64)]
    clock = Scripted()
    engine = make_engine(clock)
    create(engine, "cc-1", doc, ttl_s=10.0)
    expires = clock.now + 10.0
    clock.reads, clock.now = [expires - 0.5], expires + 0.5   # expires right after the first read
    assert [(c.id, p.expires_at) for c, p in engine.cached_contents()] == [("cc-1", expires)]
    assert engine.cached_contents() == [] and engine.stats().blocks_pinned == 0
