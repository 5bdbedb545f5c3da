"""AsyncLLM: one engine thread serving asyncio callers.

Oracles: the same engine driven synchronously (LLM-style step loop) for
outputs, and the KV manager's invariants after aborts, failures and shutdown.
"""
from __future__ import annotations

import asyncio
import contextlib

import pytest

from prefixserve import EngineConfig, LLMEngine, SamplingParams
from prefixserve.engine import AsyncLLM
from prefixserve.errors import (EngineDeadError, EngineStepError, InvalidRequestError, QueueFullError,
                                RequestAbortedError)

CONFIG = EngineConfig(model="random:qwen3-tiny", seed=0, num_kv_blocks=128, max_model_len=512)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(CONFIG)


@pytest.fixture()
def async_llm(engine):
    front = AsyncLLM(engine, max_waiting=64)
    front.start()
    yield front
    front.shutdown()
    assert not engine.has_unfinished_requests()
    engine.kv.check_integrity()
    assert engine.stats().blocks_in_use == 0


def sync_generate(engine: LLMEngine, rid: str, prompt, params: SamplingParams):
    """The oracle: the same engine stepped by hand, no threads."""
    engine.add_request(rid, prompt, params)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out


async def collect(front: AsyncLLM, rid: str, prompt, params=GREEDY):
    last = None
    async for out in front.generate(rid, prompt, params):
        last = out
    return last


def test_concurrent_requests_match_synchronous_engine(engine):
    prompts = [[11 + i, 200 + 3 * i, 42, 7 * i + 1] * (i + 1) for i in range(6)]
    expected = [sync_generate(engine, f"sync-{i}", {"prompt_token_ids": p}, GREEDY).outputs[0].token_ids
                for i, p in enumerate(prompts)]
    front = AsyncLLM(engine)
    front.start()
    try:
        async def main():
            return await asyncio.gather(*(collect(front, f"a-{i}", {"prompt_token_ids": p})
                                          for i, p in enumerate(prompts)))
        outs = asyncio.run(main())
    finally:
        front.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.finished for o in outs)
    assert engine.stats().blocks_in_use == 0


def test_rejected_request_raises_and_leaves_nothing(async_llm, engine):
    async def main():
        with pytest.raises(InvalidRequestError, match="max_model_len"):
            await async_llm.add_request("too-long", {"prompt_token_ids": [5] * 600}, GREEDY)
        with pytest.raises(InvalidRequestError, match="empty"):
            await async_llm.add_request("empty", {"prompt_token_ids": []}, GREEDY)
        return await collect(async_llm, "after", {"prompt_token_ids": [1, 2, 3]})
    assert asyncio.run(main()).finished


def test_stopping_iteration_aborts_and_frees_blocks(async_llm, engine):
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def main():
        seen = 0
        async with contextlib.aclosing(
                async_llm.generate("early-exit", {"prompt_token_ids": [3] * 40}, params)) as outs:
            async for out in outs:
                seen = len(out.outputs[0].token_ids)
                if seen >= 2:
                    break
        return seen, await async_llm.run_in_engine(lambda e: (e.has_unfinished_requests(),
                                                              e.stats()))

    seen, (unfinished, stats) = asyncio.run(main())
    assert seen >= 2
    # The abort was queued before this inspection, so it ran first: nothing is left.
    assert not unfinished and stats.blocks_in_use == 0


def test_explicit_abort_ends_a_waiting_consumer(async_llm):
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def main():
        stream = await async_llm.add_request("to-abort", {"prompt_token_ids": [9] * 20}, params)
        await stream.__anext__()
        async_llm.abort("to-abort")
        with pytest.raises(RequestAbortedError):
            async for _ in stream:
                pass
        return await async_llm.run_in_engine(lambda e: e.has_unfinished_requests())

    assert asyncio.run(main()) is False


def test_step_failure_fails_affected_requests_and_loop_keeps_running(async_llm, engine):
    real_step = engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected device failure")
        return real_step()

    async def main():
        await async_llm.run_in_engine(lambda e: setattr(e, "step", flaky_step))
        try:
            with pytest.raises(EngineStepError, match="injected device failure"):
                await collect(async_llm, "victim", {"prompt_token_ids": [4] * 30},
                              SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
            survivor = await collect(async_llm, "survivor", {"prompt_token_ids": [4] * 30})
        finally:
            await async_llm.run_in_engine(lambda e: delattr(e, "step"))
        return survivor

    survivor = asyncio.run(main())
    assert survivor.finished and len(survivor.outputs[0].token_ids) == GREEDY.max_tokens
    assert async_llm.is_running


def test_a_request_the_forward_fails_on_ends_alone_and_other_streams_finish(engine, monkeypatch):
    prompts = {f"n-{i}": [21 + i, 300 + 5 * i, 42, 9 * i + 2] * (i + 2) for i in range(5)}
    prompts["victim"] = [21, 300, 42, 2] * 6
    expected = {rid: sync_generate(engine, f"sync-{rid}", {"prompt_token_ids": p}, GREEDY)
                .outputs[0].token_ids for rid, p in prompts.items() if rid != "victim"}
    real = engine.runner.execute

    def execute(plan, rows):
        # Fails whenever the victim is in the step, whatever else is there.
        if any(seq.request_id == "victim" for seq in plan.sequences):
            raise RuntimeError("injected device failure")
        return real(plan, rows)
    monkeypatch.setattr(engine.runner, "execute", execute)
    front = AsyncLLM(engine)
    front.start()
    try:
        async def main():
            got = await asyncio.gather(*(collect(front, rid, {"prompt_token_ids": p})
                                         for rid, p in prompts.items()), return_exceptions=True)
            after = await collect(front, "after", {"prompt_token_ids": prompts["n-0"]})
            return dict(zip(prompts, got)), after
        got, after = asyncio.run(main())
    finally:
        front.shutdown()
    assert isinstance(got.pop("victim"), EngineStepError)
    assert {rid: out.outputs[0].token_ids for rid, out in got.items()} == expected
    assert all(out.finished and out.error is None for out in got.values())
    assert after.outputs[0].token_ids == expected["n-0"]
    assert not engine.has_unfinished_requests()
    engine.kv.check_integrity()
    assert engine.stats().blocks_in_use == 0


def test_queue_bound_raises_queue_full(engine):
    front = AsyncLLM(engine, max_waiting=2)
    # Not started: accepted requests stay pending, so the bound is exact.

    async def main():
        tasks = [asyncio.create_task(front.add_request(f"q-{i}", [1, 2, 3], GREEDY)) for i in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(QueueFullError, match="max_waiting"):
            await front.add_request("q-over", [1, 2, 3], GREEDY)
        front.shutdown()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return results

    results = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) for r in results)
    assert not engine.has_unfinished_requests()


def test_shutdown_fails_in_flight_requests_and_refuses_new_ones(engine):
    front = AsyncLLM(engine)
    front.start()
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def main():
        stream = await front.add_request("in-flight", {"prompt_token_ids": [8] * 20}, params)
        await stream.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, front.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await front.add_request("late", [1, 2], GREEDY)

    asyncio.run(main())
    assert not front.is_running
    assert not engine.has_unfinished_requests()
    engine.kv.check_integrity()
    assert engine.stats().blocks_in_use == 0


def test_invalid_max_waiting():
    with pytest.raises(ValueError, match="max_waiting"):
        AsyncLLM(object(), max_waiting=0)  # type: ignore[arg-type]


def test_the_waiting_queue_never_exceeds_max_waiting_even_through_preemptions():
    """A pool too small for every admitted request forces preemptions; the bound counts every
    sequence in flight (n > 1 included), so the waiting queue, preempted requests and all,
    stays within it at every step while requests beyond it get QueueFullError."""
    engine = LLMEngine(EngineConfig(model="random:qwen3-tiny", seed=0, block_size=16, num_kv_blocks=24,
                                    max_model_len=256, max_num_seqs=8))
    front = AsyncLLM(engine, max_waiting=6)
    longest = []

    def record(e):
        original = e.step

        def step():
            out = original()
            longest.append(e.scheduler.num_waiting)
            return out
        e.step = step

    front.start()

    async def main():
        await front.run_in_engine(record)
        params = [SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True, n=1 + i % 2)
                  for i in range(40)]
        streams, refused = [], 0
        for i, p in enumerate(params):
            try:
                streams.append(await front.add_request(f"w{i}", {"prompt_token_ids": [5 + i] * 60}, p))
            except QueueFullError:
                refused += 1
            await asyncio.sleep(0.01)
        for stream in streams:
            async for _ in stream:
                pass
        return refused

    try:
        refused = asyncio.run(main())
        preemptions = front.submit(lambda e: e.stats().preemptions).result(timeout=60)
    finally:
        front.shutdown()
    assert refused > 0 and preemptions > 0, (refused, preemptions)
    assert max(longest) <= 6
    engine.kv.check_integrity()
    assert engine.stats().blocks_in_use == 0
