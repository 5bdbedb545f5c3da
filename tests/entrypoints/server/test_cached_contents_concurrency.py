"""Cached contents under concurrency: create, use, re-pin and delete of contents whose blocks
coincide, interleaved by many clients of one AsyncLLM, never lose a content nor leave a pin.

Oracle: each client owns the contents it creates, so a content it created and has not deleted
must be found every time it looks; after every content is deleted no block is pinned, and the
KV manager's invariants hold.
"""
from __future__ import annotations

import asyncio
import random

from prefixserve import EngineConfig, LLMEngine, SamplingParams
from prefixserve.engine import AsyncLLM, CachedContent, CachePin
from prefixserve.errors import NotFoundError

BS = 16
DOCS = 3          # few distinct documents: most contents share their blocks with others'
CLIENTS = 24
OPS_PER_CLIENT = 100


def test_thousands_of_interleaved_content_operations_lose_nothing_and_leak_no_pin():
    rng = random.Random(0)
    docs = [[rng.randrange(10, 4000) for _ in range(3 * BS + 5)] for _ in range(DOCS)]
    engine = LLMEngine(EngineConfig(model="random:qwen3-tiny", block_size=BS, num_kv_blocks=256,
                                    max_num_seqs=32, max_pinned_fraction=0.9))
    counts = {"create": 0, "find": 0, "repin": 0, "delete": 0}

    async def client(c: int) -> None:
        crng = random.Random(c)
        mine: list[str] = []
        for op in range(OPS_PER_CLIENT):
            choice = crng.random()
            if choice < 0.35 or not mine:
                cid = f"cc-{c}-{op}"
                content = CachedContent(cid, None, docs[crng.randrange(DOCS)], None, 0)
                stream = await async_llm.add_request(
                    f"prefill-{cid}", {"prompt_token_ids": content.token_ids},
                    SamplingParams(max_tokens=1, temperature=0.0),
                    cache_pins=[CachePin(len(content.token_ids), 3600.0, content=content)])
                async for out in stream:
                    pass
                assert out.pins[0].error is None and out.pins[0].pin_id is not None
                mine.append(cid)
                counts["create"] += 1
                # the very next use finds it, whatever the other clients did meanwhile
                found, pin = await async_llm.find_cached_content(cid)
                assert found.id == cid and pin.num_tokens == 3 * BS
            elif choice < 0.65:
                cid = crng.choice(mine)
                found, _ = await async_llm.find_cached_content(cid)
                assert found.id == cid
                counts["find"] += 1
            elif choice < 0.8:
                cid = crng.choice(mine)
                # shortened or kept; TTLs far longer than any run: a pin that expired while a loaded
                # machine ran the test would take its content with it, and the next find would miss
                _, pin = await async_llm.repin_cached_content(cid, crng.choice([600.0, 3600.0]))
                assert pin.num_tokens == 3 * BS
                counts["repin"] += 1
            else:
                cid = mine.pop(crng.randrange(len(mine)))
                await async_llm.delete_cached_content(cid)
                counts["delete"] += 1
                try:
                    await async_llm.find_cached_content(cid)
                    raise AssertionError(f"{cid} was deleted but is still found")
                except NotFoundError:
                    pass
        for cid in mine:
            await async_llm.delete_cached_content(cid)
            counts["delete"] += 1

    async def run() -> None:
        await asyncio.gather(*(client(c) for c in range(CLIENTS)))

    async_llm = AsyncLLM(engine)
    async_llm.start()
    try:
        asyncio.run(run())
        leftovers = async_llm.submit(lambda e: (e.cached_contents(), e.list_pins())).result(timeout=60)
        assert leftovers == ([], [])
        stats = async_llm.submit(lambda e: e.stats()).result(timeout=60)
        assert stats.blocks_pinned == 0 and stats.blocks_in_use == 0
        async_llm.submit(lambda e: e.kv.check_integrity()).result(timeout=60)
    finally:
        async_llm.shutdown()
    assert sum(counts.values()) >= CLIENTS * OPS_PER_CLIENT
    assert counts["create"] > 500 and counts["delete"] == counts["create"]
