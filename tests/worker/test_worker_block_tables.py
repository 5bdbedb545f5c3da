"""The worker's persistent block tables against the KV manager's, step by step.

The scheduler sends each request's whole table once and then only what
changed (scheduler/output.py); the runner keeps one row per request. Whatever
the step mixes (chunked prefills, decodes crossing block boundaries,
preemption in a small pool, n > 1 forks and their copy-on-write, aborts), at
every forward each row the worker holds must equal `kv.block_table(rid)` of a
live request, and an idle engine must hold no row.
"""
from __future__ import annotations

import random

import pytest

from prefixserve import EngineConfig, LLMEngine, SamplingParams
from prefixserve.worker.block_tables import BlockTables


def engine_checking_tables(monkeypatch: pytest.MonkeyPatch, **config) -> tuple[LLMEngine, list[int]]:
    """An engine whose runner checks its rows against the KV manager after applying each plan;
    the returned list collects how many rows it held at each forward."""
    engine = LLMEngine(EngineConfig(model="random:qwen3-tiny", **config))
    runner, kv = engine.runner, engine.kv
    prepare = runner.prepare_inputs
    held: list[int] = []

    def checked(plan):
        inputs = prepare(plan)
        tables = runner.block_tables
        for seq in plan.sequences:
            assert seq.request_id in tables
        for rid in tables.request_ids():
            assert kv.has_request(rid), f"the worker holds a row for {rid!r}, which holds no blocks"
            assert tables.table(rid) == kv.block_table(rid), rid
            assert engine.scheduler.get_request(rid) in engine.scheduler.running
        held.append(len(tables))
        return inputs

    monkeypatch.setattr(runner, "prepare_inputs", checked)
    return engine, held


def rows_match_kv(engine: LLMEngine) -> None:
    """Between steps: every row of a request that still holds blocks equals its table."""
    tables = engine.runner.block_tables
    for rid in tables.request_ids():
        if engine.kv.has_request(rid):
            assert tables.table(rid) == engine.kv.block_table(rid), rid


def test_rows_follow_the_kv_tables_through_chunks_preemption_forks_and_aborts(monkeypatch) -> None:
    rng = random.Random(0)
    # 4-token blocks: decodes cross block boundaries every few steps; 40 blocks cannot hold every
    # request at once, so requests are preempted and resumed; 24-token budget chunks the prompts.
    engine, held = engine_checking_tables(monkeypatch, block_size=4, num_kv_blocks=40,
                                          max_num_batched_tokens=24, max_num_seqs=8)
    shared = [rng.randrange(10, 4000) for _ in range(18)]
    step = 0
    for i in range(14):
        prompt = (shared if i % 2 else []) + [rng.randrange(10, 4000) for _ in range(rng.randrange(3, 40))]
        params = SamplingParams(n=rng.choice([1, 1, 2, 3]), temperature=1.0, seed=i,
                                max_tokens=rng.randrange(4, 40), ignore_eos=True)
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
        if i % 5 == 4:
            engine.abort_request(f"r{i - 2}")
        for _ in range(2):
            engine.step()
            rows_match_kv(engine)
            step += 1
    while engine.has_unfinished_requests():
        engine.step()
        rows_match_kv(engine)
        step += 1
        assert step < 2000

    stats = engine.stats()
    assert stats.preemptions > 0 and stats.cow_copies > 0 and stats.cached_prompt_tokens > 0
    assert max(held) > 1
    assert len(engine.runner.block_tables) == 0
    assert stats.blocks_in_use == 0
    engine.kv.check_integrity()


def test_aborting_every_request_leaves_no_rows(monkeypatch) -> None:
    engine, _ = engine_checking_tables(monkeypatch, block_size=4, num_kv_blocks=64)
    for i in range(3):
        engine.add_request(f"r{i}", {"prompt_token_ids": list(range(10 + i, 30 + i))},
                           SamplingParams(n=2, max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert len(engine.runner.block_tables) == 6   # three prompts, each forked into two samples
    engine.abort_request(["r0", "r1", "r2"])
    assert len(engine.runner.block_tables) == 0


def test_a_request_id_reused_after_it_finished_gets_a_fresh_row(monkeypatch) -> None:
    engine, _ = engine_checking_tables(monkeypatch, block_size=4, num_kv_blocks=64)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": list(range(10, 23))}, params)
    engine.add_request("b", {"prompt_token_ids": list(range(40, 60))}, SamplingParams(max_tokens=30,
                                                                                       ignore_eos=True))
    while not any(out.request_id == "a" and out.finished for out in engine.step()):
        pass
    # b keeps the engine busy, so a's row is dropped through the next plan, as the new "a" arrives
    engine.add_request("a", {"prompt_token_ids": list(range(100, 109))}, params)
    while engine.has_unfinished_requests():
        engine.step()
    assert len(engine.runner.block_tables) == 0


def test_block_tables_grow_and_reuse_rows() -> None:
    tables = BlockTables(rows=1, columns=2)
    tables.write("a", [5, 6, 7])
    tables.write("b", [1])
    tables.append("b", [2, 3, 4, 8])
    assert tables.table("a") == [5, 6, 7] and tables.table("b") == [1, 2, 3, 4, 8]
    tables.write("b", [9])   # a shorter table replaces a longer one: the rest is padding again
    assert tables.array[tables.row("b")].tolist()[:5] == [9, 0, 0, 0, 0]
    row = tables.row("a")
    tables.drop("a")
    assert "a" not in tables and not tables.array[row].any()
    tables.write("c", [4])
    assert tables.row("c") == row and len(tables) == 2
    with pytest.raises(KeyError, match="'a'"):
        tables.append("a", [1])
