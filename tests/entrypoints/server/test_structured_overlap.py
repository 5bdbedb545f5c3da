"""Grammar work off the critical path: masks computed on the sampler's worker thread while the
forward runs, and grammars compiled off the engine thread on the async path (AsyncLLM, server).

Oracles: the JSON schema (jsonschema_rs); the same seeded requests on an engine where the masks
are computed inline by the sampler, or where memory is ample and nothing is preempted (tokens
must be identical); the inline sampler for a failing row; the pool's invariants at the end.
Overlap is shown without timing: the forward waits for a mask to be filled, which can only
happen if the mask work runs on another thread at the same time.
"""
from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema_rs
import pytest
import torch

from prefixserve import LLM, EngineConfig, LLMEngine, SamplingParams
from prefixserve.engine import AsyncLLM
from prefixserve.entrypoints.server.app import build_app
from prefixserve.entrypoints.server.config import ServerConfig
from prefixserve.errors import InvalidRequestError
from prefixserve.structured import StructuredOutput
from prefixserve.structured.constraint import Constraint
from prefixserve.structured.grammar import GrammarCompiler
from prefixserve.tokenizer import load_tokenizer
from prefixserve.worker.sampler import Sampler, SamplingRow

from live_server import LiveServer, assert_pool_idle

MODEL = "random:qwen3-tiny"
ENGINE = dict(model=MODEL, seed=0, block_size=16, num_kv_blocks=256, max_model_len=1024)
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 4},
    "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "tags", "n"], "additionalProperties": False}
HELD = SamplingParams(max_tokens=120, temperature=1.0, seed=3,
                      structured=StructuredOutput.json_schema(SCHEMA))


def assert_matches_schema(text: str) -> None:
    jsonschema_rs.validate(SCHEMA, json.loads(text))


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(**ENGINE)


class _WaitsForAMask:
    """The model, whose forward first waits until a grammar mask of its step has been filled."""

    def __init__(self, model, filled: threading.Event) -> None:
        self._model = model
        self._filled = filled

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, *args, **kwargs):
        assert self._filled.wait(60), "no mask was filled while the forward waited for one"
        self._filled.clear()
        return self._model(*args, **kwargs)


def test_masks_are_filled_on_the_worker_while_the_forward_runs(llm, monkeypatch):
    expected = [o.outputs[0].token_ids for o in llm.generate(["Person:", "Someone:"], HELD)]
    filled, threads = threading.Event(), set()
    fill = Constraint.fill

    def recording_fill(self, output_token_ids, bitmask):
        fill(self, output_token_ids, bitmask)
        threads.add(threading.current_thread().name)
        filled.set()

    monkeypatch.setattr(Constraint, "fill", recording_fill)
    overlapped = LLM(**ENGINE)
    runner = overlapped.engine.runner
    runner.sampler.overlap_masks = True  # as on an accelerator
    runner.model = _WaitsForAMask(runner.model, filled)
    outs = overlapped.generate(["Person:", "Someone:"], HELD)
    assert [o.outputs[0].token_ids for o in outs] == expected
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        assert_matches_schema(out.outputs[0].text)
    assert threads and all(name.startswith("prefixserve-masks") for name in threads), threads
    overlapped.engine.kv.check_integrity()


@pytest.mark.parametrize("started", [True, False], ids=["on-the-worker", "inline"])
def test_a_row_that_left_its_grammar_fails_alone(llm, started):
    tokenizer = llm.tokenizer
    compiler = GrammarCompiler(tokenizer.backend.to_str(), tokenizer.vocab_size,
                               sorted(tokenizer.eos_token_ids))
    spec = StructuredOutput.json_schema(SCHEMA)
    rows = [SamplingRow(SamplingParams(temperature=0.0), (), tokenizer.encode('{"name": "x"')),
            SamplingRow(SamplingParams(temperature=0.0), (), tokenizer.encode("not json"),
                        constraint=compiler.constraint(spec)),
            SamplingRow(SamplingParams(temperature=0.0), (), tokenizer.encode('{"name": "x"'),
                        constraint=compiler.constraint(spec))]
    logits = torch.randn(3, tokenizer.vocab_size, generator=torch.Generator().manual_seed(1))
    sampler = Sampler(tokenizer.vocab_size, overlap_masks=started)
    masks = sampler.start_masks(rows)
    assert (masks is not None) == started
    result = sampler(logits.clone(), rows, masks=masks)
    assert result.token_ids[0] == int(torch.argmax(logits[0])) and result.errors[0] is None
    assert result.token_ids[1] == -1 and isinstance(result.errors[1], InvalidRequestError)
    # The oracle for the good constrained row: the best token its grammar allows, found by
    # asking a fresh matcher about each token in order of logit.
    probe = compiler.constraint(spec)
    prefix = rows[2].output_token_ids
    for token in torch.argsort(logits[2], descending=True).tolist():
        if probe.matcher.validate_tokens(list(prefix) + [token]) == len(prefix) + 1:
            break
    assert result.token_ids[2] == token and result.errors[2] is None


def test_preempted_and_forked_samples_keep_their_grammar(llm):
    """n = 2 forks each sample's matcher; a pool this small preempts requests, whose matchers
    then re-sync from the recomputed output, on the mask worker. Tokens must equal those of a
    roomy engine computing its masks inline."""
    prompts = [f"Record {i}:" for i in range(6)]
    params = SamplingParams(max_tokens=120, temperature=1.0, seed=11, n=2,
                            structured=StructuredOutput.json_schema(SCHEMA))
    roomy = llm.generate(prompts, params)
    tight = LLM(**{**ENGINE, "num_kv_blocks": 12})
    tight.engine.runner.sampler.overlap_masks = True  # the roomy one computes them inline
    cramped = tight.generate(prompts, params)
    assert tight.stats().preemptions > 0
    for a, b in zip(roomy, cramped):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        for c in b.outputs:
            assert_matches_schema(c.text)
    tight.engine.kv.check_integrity()
    assert tight.stats().blocks_in_use == 0


class GatedCompiler(GrammarCompiler):
    """Compiles only once the test opens the gate: a grammar as slow to compile as it likes."""

    def __init__(self) -> None:
        tokenizer = load_tokenizer(MODEL)
        super().__init__(tokenizer.backend.to_str(), tokenizer.vocab_size, sorted(tokenizer.eos_token_ids))
        self.entered = threading.Event()
        self.gate = threading.Event()

    def constraint(self, spec: StructuredOutput) -> Constraint:
        self.entered.set()
        self.gate.wait(300)   # opened by the test; the bound only keeps a failed test from hanging
        return super().constraint(spec)


def test_async_requests_keep_streaming_while_a_grammar_compiles():
    compiler = GatedCompiler()
    engine = LLMEngine(EngineConfig(**ENGINE), grammar_compiler=compiler)
    front = AsyncLLM(engine, max_waiting=16)
    front.start()

    async def scenario() -> None:
        plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        stream = await front.add_request("plain", "The scheduler admits", plain)
        slow = asyncio.ensure_future(front.add_request("held", "Person:", HELD))
        await asyncio.to_thread(compiler.entered.wait, 60)
        last = None
        async for out in stream:  # every token arrives while the grammar is still compiling
            last = out
        assert last.finished and len(last.outputs[0].token_ids) == 24
        assert not slow.done()
        compiler.gate.set()
        held = None
        async for out in await asyncio.wait_for(slow, 120):
            held = out
        assert held.outputs[0].finish_reason == "stop"
        assert_matches_schema(held.outputs[0].text)
        with pytest.raises(InvalidRequestError) as info:
            await front.add_request("bad", "x", SamplingParams(
                structured=StructuredOutput("lark", "start: undefined_rule")))
        assert info.value.param == "response_format"

    try:
        asyncio.run(asyncio.wait_for(scenario(), 300))   # a loaded 2-core machine: minutes
    finally:
        compiler.gate.set()
        front.shutdown()
    assert not engine.has_unfinished_requests()
    engine.kv.check_integrity()
    assert engine.stats().blocks_in_use == 0


def test_the_server_answers_others_while_a_grammar_compiles_and_400s_a_bad_one():
    compiler = GatedCompiler()
    app = build_app(LLMEngine(EngineConfig(**ENGINE), grammar_compiler=compiler),
                    ServerConfig(max_waiting=16))
    response_format = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
    with LiveServer(app) as server, ThreadPoolExecutor(1) as pool:
        chat = server.base_url + "/v1/chat/completions"
        try:
            slow = pool.submit(httpx.post, chat, timeout=120, json={
                "model": MODEL, "messages": [{"role": "user", "content": "A person?"}],
                "max_tokens": 120, "temperature": 1.0, "seed": 3, "response_format": response_format})
            assert compiler.entered.wait(60)
            r = httpx.post(server.base_url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "The scheduler admits", "max_tokens": 8, "temperature": 0.0})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] >= 1
            assert not slow.done()
        finally:
            compiler.gate.set()
        r = slow.result()
        assert r.status_code == 200, r.text
        assert_matches_schema(r.json()["choices"][0]["message"]["content"])
        bad = {"type": "json_schema", "json_schema": {"name": "r", "schema": {
            "type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}}}
        r = httpx.post(chat, timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "response_format": bad})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "response_format"
        assert_pool_idle(server)
