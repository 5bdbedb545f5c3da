"""A failure in one request's part of a step ends that request alone.

Oracle: the same workload run cleanly on the same engine. With a failure injected for
one request (a bad field that slipped past validation, or a batched forward that raises
whenever that request is in the step, after leaving junk in the step's K/V slots), that
request ends with an error and every other request produces exactly the clean run's
tokens (greedy and seeded sampling do not depend on what else shares the batch). After
every step the KV bookkeeping passes its audit, and at the end every block is free.
"""
from __future__ import annotations

import random

import pytest
import torch

from prefixserve import EngineConfig, LLMEngine, SamplingParams
from prefixserve.engine.outputs import CachePin
from prefixserve.model.kv_layout import write_kv

VICTIM = "victim"


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


PREFIX = ids(1, 40)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=kw.pop("max_tokens", 10), ignore_eos=True, **kw)


def workload(victim_params: SamplingParams | None = None, victim_pins=()) -> list[tuple]:
    """A busy batch: chunked prompts sharing a prefix with the victim (admitted before them, so
    it registers the blocks they reuse in the same step), seeded sampling, n = 2, logprobs."""
    return [
        ("solo", ids(2, 30), greedy(), ()),
        (VICTIM, PREFIX + ids(3, 12), victim_params or greedy(max_tokens=12), victim_pins),
        ("near", PREFIX + ids(4, 9), greedy(), ()),
        ("seeded", PREFIX + ids(5, 21), SamplingParams(temperature=0.9, top_p=0.9, seed=5,
                                                       max_tokens=10, ignore_eos=True), ()),
        ("pair", PREFIX + ids(6, 3), SamplingParams(n=2, temperature=1.0, seed=6, max_tokens=8,
                                                    ignore_eos=True), ()),
        ("scored", ids(7, 17), greedy(logprobs=2), ()),
    ]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    # A token budget of 64 chunks the prompts and spreads admissions over several steps.
    return LLMEngine(EngineConfig(model="random:qwen3-tiny", seed=0, block_size=16,
                                  num_kv_blocks=128, max_model_len=512, max_num_batched_tokens=64))


def run(engine: LLMEngine, requests, max_steps: int = 1000):
    """Runs requests to completion from a cold cache; returns (final outputs, failures, steps)."""
    engine.reset_prefix_cache()
    for rid, prompt, params, pins in requests:
        engine.add_request(rid, {"prompt_token_ids": prompt}, params, cache_pins=pins)
    done, failures, steps = {}, {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        assert steps <= max_steps
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        failures.update(engine.last_step_failures())
        engine.kv.check_integrity()
    stats = engine.stats()
    assert stats.blocks_in_use == 0 and stats.num_running == 0 and stats.num_waiting == 0
    assert len(engine.runner.block_tables) == 0
    return done, failures, steps


def tokens_of(out) -> list[list[int]]:
    return [o.token_ids for o in out.outputs]


@pytest.fixture(scope="module")
def clean(engine):
    done, failures, _ = run(engine, workload())
    assert not failures and all(o.error is None for o in done.values())
    return done


def assert_only_victim_failed(done, failures, clean):
    assert set(done) == set(clean)
    assert set(failures) == {VICTIM}
    victim = done[VICTIM]
    assert victim.finished and victim.error == failures[VICTIM]
    assert all(o.finish_reason == "abort" for o in victim.outputs)
    for rid, out in done.items():
        if rid == VICTIM:
            continue
        assert out.error is None, rid
        assert tokens_of(out) == tokens_of(clean[rid]), rid
        assert [o.text for o in out.outputs] == [o.text for o in clean[rid].outputs], rid
        assert [o.finish_reason for o in out.outputs] == [o.finish_reason for o in clean[rid].outputs]


def slipped(params: SamplingParams, field: str, value) -> SamplingParams:
    setattr(params, field, value)  # past validation, as a bug in a front end could let it
    return params


@pytest.mark.parametrize("field,value,stage", [
    ("stop_token_ids", None, "preparing its sampling"),
    ("logprobs", 10**6, "sampling"),
    ("stop", [None], "text"),
])
def test_a_bad_field_ends_its_request_alone(engine, clean, field, value, stage):
    params = slipped(greedy(max_tokens=12), field, value)
    done, failures, _ = run(engine, workload(params))
    assert_only_victim_failed(done, failures, clean)
    assert stage in failures[VICTIM]


def test_a_pin_that_cannot_be_placed_ends_its_request_alone(engine, clean):
    pin = CachePin(num_tokens=32)
    object.__setattr__(pin, "ttl_s", "soon")  # past CachePin's own check
    done, failures, _ = run(engine, workload(victim_pins=(pin,)))
    assert_only_victim_failed(done, failures, clean)
    assert "pins" in failures[VICTIM]
    assert engine.list_pins() == []


class FailingForward:
    """runner.execute that, when `victim` is scheduled at or past `from_pos`, does the host half
    of the step and the copies, writes junk into every slot the step was to write (as a
    forward dying part-way may), then raises. `always`: fails every step that runs anything."""

    def __init__(self, engine: LLMEngine, victim: str = VICTIM, from_pos: int = 0,
                 always: bool = False) -> None:
        self.runner = engine.runner
        self.real = engine.runner.execute
        self.victim, self.from_pos, self.always = victim, from_pos, always
        self.failed_steps = 0

    def __call__(self, plan, rows):
        hit = any(s.request_id.split("#")[0] == self.victim and s.start_pos >= self.from_pos
                  for s in plan.sequences)
        if not plan.sequences or not (hit or self.always):
            return self.real(plan, rows)
        runner = self.runner
        runner.prepare_inputs(plan)
        runner.copy_blocks(plan.block_copies)
        bs = runner.block_size
        slots = []
        for seq in plan.sequences:
            table = runner.block_tables.table(seq.request_id)
            slots += [table[pos // bs] * bs + pos % bs for pos in range(seq.start_pos, seq.seq_len)]
        row = (runner.config.num_key_value_heads, runner.config.head_dim)
        for cache in runner.kv_caches:
            junk = (100.0 * torch.randn(len(slots), *row)).to(cache.dtype)
            write_kv(cache, runner.kv_layout, torch.tensor(slots, dtype=torch.long), junk, junk)
        self.failed_steps += 1
        raise RuntimeError("injected forward failure")


@pytest.mark.parametrize("from_pos", [0, len(PREFIX) + 12 + 3], ids=["in-prefill", "mid-decode"])
def test_a_forward_that_fails_with_one_request_ends_only_that_request(
        engine, clean, monkeypatch, from_pos):
    failing = FailingForward(engine, from_pos=from_pos)
    monkeypatch.setattr(engine.runner, "execute", failing)
    done, failures, _ = run(engine, workload())
    assert failing.failed_steps >= 2  # with neighbours first, then alone
    assert_only_victim_failed(done, failures, clean)
    assert "forward pass with it alone" in failures[VICTIM]
    if from_pos:
        # The step feeding its 4th token (at prompt length + 3) failed: the 4 it had are kept.
        assert len(done[VICTIM].outputs[0].token_ids) == 4
        assert done[VICTIM].outputs[0].token_ids == clean[VICTIM].outputs[0].token_ids[:4]


def test_a_forward_failing_for_everyone_ends_everyone_in_bounded_steps(engine, clean, monkeypatch):
    failing = FailingForward(engine, always=True)
    monkeypatch.setattr(engine.runner, "execute", failing)
    requests = workload()
    done, failures, steps = run(engine, requests)
    assert set(done) == set(failures) == {rid for rid, *_ in requests}
    assert all(o.error and o.outputs[0].finish_reason == "abort" for o in done.values())
    # A bisection per failed step: 2k - 1 steps for the k requests it held.
    assert steps <= 2 * len(requests)
    # The engine serves again once the forward does.
    monkeypatch.setattr(engine.runner, "execute", failing.real)
    again, failures, _ = run(engine, [r for r in workload() if r[0] == "near"])
    assert not failures and tokens_of(again["near"]) == tokens_of(clean["near"])


def test_a_failed_undo_ends_the_steps_requests_and_drops_the_cache(engine, monkeypatch):
    monkeypatch.setattr(engine.runner, "execute", FailingForward(engine, always=True))

    def broken_rollback(plan):
        raise RuntimeError("injected rollback failure")
    monkeypatch.setattr(engine.scheduler, "rollback", broken_rollback)
    requests = workload()[:3]
    done, failures, _ = run(engine, requests)
    assert set(done) == set(failures) == {rid for rid, *_ in requests}
    assert all("recover" in why for why in failures.values())
    assert engine.stats().blocks_cached == 0


class FailOnce:
    """runner.execute that raises `error` in its `at`-th call that runs anything, after junk
    writes like FailingForward's, and runs normally otherwise."""

    def __init__(self, engine: LLMEngine, at: int, error: BaseException) -> None:
        self.inner = FailingForward(engine, always=True)
        self.at, self.error, self.calls = at, error, 0

    def __call__(self, plan, rows):
        if plan.sequences:
            self.calls += 1
            if self.calls == self.at:
                try:
                    self.inner(plan, rows)
                except RuntimeError:
                    raise self.error from None
        return self.inner.real(plan, rows)


@pytest.mark.parametrize("at", [1, 3, 6])
def test_a_transient_forward_failure_loses_nothing(engine, clean, monkeypatch, at):
    # Every request of the failed step is retried and passes: nobody fails and every output,
    # the would-be victim's included, is the clean run's.
    monkeypatch.setattr(engine.runner, "execute", FailOnce(engine, at, RuntimeError("transient")))
    done, failures, _ = run(engine, workload())
    assert not failures
    assert {rid: tokens_of(o) for rid, o in done.items()} == {rid: tokens_of(o) for rid, o in clean.items()}


def test_an_interrupted_step_is_undone_before_the_interrupt_propagates(engine, clean, monkeypatch):
    monkeypatch.setattr(engine.runner, "execute", FailOnce(engine, 4, KeyboardInterrupt()))
    engine.reset_prefix_cache()
    for rid, prompt, params, pins in workload():
        engine.add_request(rid, {"prompt_token_ids": prompt}, params, cache_pins=pins)
    done = {}
    with pytest.raises(KeyboardInterrupt):
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
    engine.kv.check_integrity()
    # Whoever catches it may carry on from where the step began.
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        engine.kv.check_integrity()
    assert engine.stats().blocks_in_use == 0
    assert {rid: tokens_of(o) for rid, o in done.items()} == {rid: tokens_of(o) for rid, o in clean.items()}


def test_a_fork_that_fails_part_way_ends_its_request_alone(engine, clean, monkeypatch):
    real_fork = engine.scheduler._fork

    def fork(parent, index):
        if parent.request_id == VICTIM and index == 2:
            raise RuntimeError("injected fork failure")
        return real_fork(parent, index)
    monkeypatch.setattr(engine.scheduler, "_fork", fork)
    params = SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=8, ignore_eos=True)
    done, failures, _ = run(engine, workload(params))
    assert_only_victim_failed(done, failures, clean)
    assert "applying its sampled token" in failures[VICTIM]
    # The sample forked before the failure is ended and reported with it.
    assert [o.index for o in done[VICTIM].outputs] == [0, 1]
