"""The redis:// store against a real redis-server started by the test on a free port."""
from __future__ import annotations

import pytest

from kv_store_helpers import BLOCK, PARAMS, POOL_BLOCKS, documents, full_blocks, reference, run_child
from prefixserve import LLM
from redis_server import free_port



@pytest.fixture(scope="module")
def model(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("qwen3"))


@pytest.fixture(scope="module")
def docs() -> list[list[int]]:
    return documents(4, 100, seed=5)


@pytest.fixture(scope="module")
def want(docs, model) -> list[list[int]]:
    return reference(docs, model)


def test_two_processes_share_a_redis_server(redis_server, docs, want, model):
    first = run_child(docs, [redis_server.url], model=model, blocks=64)
    assert [c for c, _ in first["result"]] == [0] * len(docs)
    # This process never computed them: every full block comes from the other's writes.
    llm = LLM(model, dtype="float32", num_kv_blocks=64, kv_stores=[redis_server.url])
    outs = [llm.generate({"prompt_token_ids": d}, PARAMS)[0] for d in docs]
    assert [o.outputs[0].token_ids for o in outs] == want
    assert [o.num_cached_tokens for o in outs] == [full_blocks(d) for d in docs]
    (stats,) = llm.stats().kv_stores
    assert stats.hits == sum(full_blocks(d) for d in docs) // BLOCK and stats.errors == 0
    hashes = [llm.engine.kv.hasher.hash_prompt(d, BLOCK) for d in docs]
    held = llm.engine.kv_stores_hold([h for hs in hashes for h in hs] + [b"\x01" * 8])
    assert held[:-1] == [0] * (len(held) - 1) and held[-1] is None
    # The keys a router would look for are exactly the ones on the server.
    import redis
    on_server = {k.decode() for k in redis.Redis.from_url(redis_server.url).scan_iter("prefixserve:kv:*")}
    scope = llm.engine.kv_store_scope
    assert {f"prefixserve:kv:{scope}/{h.hex()}" for hs in hashes for h in hs} <= on_server
    llm.close()


def test_redis_killed_mid_run_every_request_still_completes(redis_server, docs, want, model):
    llm = LLM(model, dtype="float32", num_kv_blocks=POOL_BLOCKS, kv_stores=[redis_server.url])
    first = [llm.generate({"prompt_token_ids": d}, PARAMS)[0] for d in docs]
    llm.engine._kv_stores.writer.flush()
    # All at once: the pool admits some (loading them from Redis), the server dies between
    # two steps, and the rest are admitted while it is gone.
    engine = llm.engine
    for i, d in enumerate(docs):
        engine.add_request(f"mid-{i}", {"prompt_token_ids": d}, PARAMS)
    done = {}
    for out in engine.step():
        if out.finished:
            done[out.request_id] = out
    hits_before_kill = llm.stats().kv_stores[0].hits
    redis_server.kill()
    while len(done) < len(docs):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    mid = [done[f"mid-{i}"] for i in range(len(docs))]
    after = [llm.generate({"prompt_token_ids": d}, PARAMS)[0] for d in docs]
    assert hits_before_kill > 0
    for outs in (first, mid, after):
        assert [o.outputs[0].token_ids for o in outs] == want
        assert all(o.finished and o.error is None for o in outs)
    (stats,) = llm.stats().kv_stores
    assert stats.errors >= 1
    llm.engine.kv.check_integrity()
    assert llm.stats().blocks_in_use == 0
    llm.close()   # flushing to a dead server is a counted fault, not a crash


def test_an_unreachable_redis_is_a_miss_from_the_start(docs, want, model):
    url = f"redis://127.0.0.1:{free_port()}/0?timeout=0.2"
    llm = LLM(model, dtype="float32", num_kv_blocks=POOL_BLOCKS, kv_stores=[url])
    outs = [llm.generate({"prompt_token_ids": d}, PARAMS)[0] for d in docs * 2]
    assert [o.outputs[0].token_ids for o in outs] == want * 2
    assert llm.stats().kv_stores[0].errors >= 1
    llm.close()
