"""KV stores beneath the pool, end to end on a tiny Qwen3 checkpoint (greedy, float32).

Every output is compared with the same prompt run with prefix caching off; hits are checked
against what the pool alone could hold, so a pass means the blocks came back from a store
and were right.
"""
from __future__ import annotations

import pytest

from kv_store_helpers import (BLOCK, PARAMS, POOL_BLOCKS, blocks_cached_after, documents,
                              full_blocks, reference, run_child)
from prefixserve import LLM


@pytest.fixture(scope="module")
def model(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("qwen3"))


@pytest.fixture(scope="module")
def docs() -> list[list[int]]:
    return documents()


@pytest.fixture(scope="module")
def want(docs, model) -> list[list[int]]:
    return reference(docs, model)


def test_the_oracle_sees_wrong_kv(docs, want, model):
    """Outputs of this model depend on the cached K/V: negating it changes them, so equal
    outputs below mean right blocks."""
    llm = LLM(model, dtype="float32", num_kv_blocks=64)
    llm.generate([{"prompt_token_ids": d} for d in docs], PARAMS)
    for cache in llm.engine.runner.kv_caches:
        cache.mul_(-1.0)
    outs = llm.generate([{"prompt_token_ids": d} for d in docs], PARAMS)
    assert all(o.outputs[0].token_ids != w for o, w in zip(outs, want))


def run_rounds(llm: LLM, docs, rounds: int = 2) -> list[list]:
    """Each document alone, round after round: the pool holds two, so later rounds find the
    others only in the stores."""
    results = []
    for _ in range(rounds):
        outs = [llm.generate({"prompt_token_ids": d}, PARAMS)[0] for d in docs]
        results.append([(o.num_cached_tokens, o.outputs[0].token_ids) for o in outs])
        llm.engine.kv.check_integrity()
    return results


def assert_all_free(llm: LLM) -> None:
    s = llm.stats()
    assert s.blocks_in_use == 0 and s.num_running == 0 and s.num_waiting == 0


@pytest.mark.parametrize("write", ["back", "through"])
@pytest.mark.parametrize("kind", ["mem", "file"])
def test_blocks_the_pool_evicted_come_back_from_the_store(kind, write, docs, want, model, tmp_path):
    assert len(docs) * len(docs[0]) // BLOCK > 2 * POOL_BLOCKS   # the pool cannot hold them
    url = "mem://?size=64MiB" if kind == "mem" else f"file://{tmp_path}"
    llm = LLM(model, dtype="float32", num_kv_blocks=POOL_BLOCKS, kv_stores=[url],
              kv_store_write=write)
    first, second = run_rounds(llm, docs)
    assert [t for _, t in first] == want and [t for _, t in second] == want
    assert [c for c, _ in first] == [0] * len(docs)
    assert [c for c, _ in second] == [full_blocks(d) for d in docs]
    llm.engine._kv_stores.writer.flush()
    (stats,) = llm.stats().kv_stores
    assert stats.hits == sum(full_blocks(d) for d in docs) // BLOCK
    assert stats.rejected == stats.errors == stats.dropped_writes == 0
    assert_all_free(llm)
    llm.close()


def test_mem_then_file_spill_and_both_serve(docs, want, model, tmp_path):
    llm = LLM(model, dtype="float32", num_kv_blocks=POOL_BLOCKS,
              kv_stores=["mem://?size=200KiB", f"file://{tmp_path}"])
    rounds = run_rounds(llm, docs, rounds=3)
    for r in rounds:
        assert [t for _, t in r] == want
    assert [c for c, _ in rounds[2]] == [full_blocks(d) for d in docs]
    mem, disk = llm.stats().kv_stores
    assert mem.hits > 0 and disk.hits > 0 and disk.writes > 0   # the memory store spilled
    assert mem.bytes_held <= 200 * 1024
    llm.close()


def test_close_drains_the_memory_store_into_the_file_store(docs, want, model, tmp_path):
    url = f"file://{tmp_path}"
    with LLM(model, dtype="float32", num_kv_blocks=POOL_BLOCKS,
             kv_stores=["mem://?size=64MiB", url]) as llm:
        run_rounds(llm, docs, rounds=1)
        assert not list(tmp_path.rglob("*.kvb"))   # evicted blocks went to memory only
    # A process with the file store alone finds every block: the pool's and the memory's.
    fresh = run_child(docs, [url], model=model, blocks=64)
    assert [t for _, t in fresh["result"]] == want
    assert [c for c, _ in fresh["result"]] == [full_blocks(d) for d in docs]


def test_a_restarted_process_hits_what_the_last_one_computed(docs, want, model, tmp_path):
    url = f"file://{tmp_path}"
    # The first process's pool holds every block: nothing is evicted, so only the flush at
    # its exit (no close() called) can have written them.
    first = run_child(docs, [url], model=model, blocks=64)
    assert [c for c, _ in first["result"]] == [0] * len(docs)
    assert first["stats"][0]["writes"] == 0
    second = run_child(docs, [url], model=model, blocks=64)
    assert [t for _, t in second["result"]] == want
    assert [c for c, _ in second["result"]] == [full_blocks(d) for d in docs]
    assert second["stats"][0]["hits"] == sum(full_blocks(d) for d in docs) // BLOCK


def test_close_flushes_the_pool_to_the_file_store(docs, want, model, tmp_path):
    url = f"file://{tmp_path}"
    with LLM(model, dtype="float32", num_kv_blocks=64, kv_stores=[url]) as llm:
        llm.generate([{"prompt_token_ids": d} for d in docs[:2]], PARAMS)
    assert len(list(tmp_path.rglob("*.kvb"))) == sum(blocks_cached_after(d) for d in docs[:2])
    fresh = LLM(model, dtype="float32", num_kv_blocks=64, kv_stores=[url])
    outs = fresh.generate([{"prompt_token_ids": d} for d in docs[:2]], PARAMS)
    assert [o.outputs[0].token_ids for o in outs] == want[:2]
    assert [o.num_cached_tokens for o in outs] == [full_blocks(d) for d in docs[:2]]
    fresh.close()


def _corrupt(files) -> dict[str, int]:
    """A different fault in each file; returns how many of each."""
    kinds = ["flip_payload", "flip_header", "truncate", "empty", "garbage", "append"]
    done: dict[str, int] = {}
    for i, path in enumerate(files):
        kind = kinds[i % len(kinds)]
        data = bytearray(path.read_bytes())
        if kind == "flip_payload":
            data[len(data) - 40] ^= 0xFF
        elif kind == "flip_header":
            data[12] ^= 0x01
        elif kind == "truncate":
            data = data[:len(data) // 2]
        elif kind == "empty":
            data = bytearray()
        elif kind == "garbage":
            data = bytearray(b"\x00" * len(data))
        else:
            data += b"\x00"
        path.write_bytes(bytes(data))
        done[kind] = done.get(kind, 0) + 1
    return done


def test_corrupted_and_truncated_files_never_change_an_output(docs, want, model, tmp_path):
    url = f"file://{tmp_path}"
    run_child(docs, [url], model=model, blocks=64, close=True)
    files = sorted(tmp_path.rglob("*.kvb"))
    assert len(files) >= 36
    damaged = files[::3]
    _corrupt(damaged)
    llm = LLM(model, dtype="float32", num_kv_blocks=64, kv_stores=[url])
    outs = [llm.generate({"prompt_token_ids": d}, PARAMS)[0] for d in docs]
    assert [o.outputs[0].token_ids for o in outs] == want
    (stats,) = llm.stats().kv_stores
    assert stats.rejected > 0
    # A chain stops at its first refused block, so fewer tokens than every full block hit.
    assert sum(o.num_cached_tokens for o in outs) < sum(full_blocks(d) for d in docs)
    # Refused records are deleted; the damaged files not reached stay as they were.
    assert len(list(tmp_path.rglob("*.kvb"))) == len(files) - stats.rejected
    llm.engine.kv.check_integrity()
    llm.close()


def test_other_weights_with_the_same_shapes_get_no_hits(tiny_checkpoint, tmp_path):
    from checkpoint_factory import write_tiny_checkpoint

    ckpt_a = tiny_checkpoint("qwen3")
    ckpt_b = write_tiny_checkpoint(tmp_path / "other", "qwen3", seed=1)
    prompts = documents(3, 70, seed=3)
    url = f"file://{tmp_path / 'store'}"
    a = LLM(str(ckpt_a), dtype="float32", num_kv_blocks=64, kv_stores=[url])
    a.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    a.close()
    b = LLM(str(ckpt_b), dtype="float32", num_kv_blocks=64, kv_stores=[url])
    # Same config and file sizes: the model identity (and so every block hash) is the same,
    # so only the weights digest in the key scope keeps b from a's blocks.
    assert a.engine.info.model_identity == b.engine.info.model_identity
    outs = b.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0]
    assert [o.outputs[0].token_ids for o in outs] == reference(prompts, str(ckpt_b))
    b.close()
    # And a's own weights still hit.
    again = LLM(str(ckpt_a), dtype="float32", num_kv_blocks=64, kv_stores=[url])
    outs = again.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    assert [o.num_cached_tokens for o in outs] == [full_blocks(p) for p in prompts]
    again.close()


def test_salted_blocks_are_found_only_with_their_salt(docs, model, tmp_path):
    url = f"file://{tmp_path}"
    llm = LLM(model, dtype="float32", num_kv_blocks=64, kv_stores=[url])
    llm.generate({"prompt_token_ids": docs[0], "cache_salt": "tenant-a"}, PARAMS)
    llm.close()
    other = LLM(model, dtype="float32", num_kv_blocks=64, kv_stores=[url])
    b = other.generate({"prompt_token_ids": docs[0], "cache_salt": "tenant-b"}, PARAMS)[0]
    plain = other.generate({"prompt_token_ids": docs[0]}, PARAMS)[0]
    a = other.generate({"prompt_token_ids": docs[0], "cache_salt": "tenant-a"}, PARAMS)[0]
    assert (b.num_cached_tokens, plain.num_cached_tokens) == (0, 0)
    assert a.num_cached_tokens == full_blocks(docs[0])
    other.close()


def test_a_full_disk_costs_misses_not_answers(docs, want, model, tmp_path):
    url = f"file://{tmp_path}"
    child = run_child(docs, [url], model=model, blocks=POOL_BLOCKS, rounds=2, fsize=1024,
                      close=True)
    assert [t for _, t in child["result"]] == want * 2
    (stats,) = child["stats"]
    assert stats["errors"] >= 1 and stats["writes"] == 0
    assert not list(tmp_path.rglob("*.kvb")) and not list(tmp_path.rglob(".tmp*"))
