"""Structured output in the engine and the sampler: llguidance masks applied to constrained rows.

Oracles: the JSON schema (jsonschema_rs) for every constrained output; an engine with prefix
caching off running each unconstrained prompt alone (a constrained neighbour in the batch must not
change an unconstrained row's tokens); a brute-force loop for the mask op; a fresh matcher for the
state a rolled-back one must return to; the pool's invariants at the end.
"""
from __future__ import annotations

import json

import jsonschema_rs
import pytest
import torch

from prefixserve import LLM, SamplingParams
from prefixserve.errors import InvalidRequestError
from prefixserve.structured import StructuredOutput
from prefixserve.structured.grammar import GrammarCompiler
from prefixserve.structured.mask import add_bias, mask_bias
from prefixserve.worker.sampler import Sampler, SamplingRow

ENGINE = dict(model="random:qwen3-tiny", seed=0, block_size=16, num_kv_blocks=256, max_model_len=1024)
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "pets": {"type": "array", "items": {"type": "string", "enum": ["cat", "dog"]}, "maxItems": 3},
    "ok": {"type": "boolean"}},
    "required": ["name", "age", "pets", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(**ENGINE)


def assert_idle(llm: LLM) -> None:
    llm.engine.kv.check_integrity()
    assert llm.stats().blocks_in_use == 0


def test_json_schema_outputs_always_parse_and_match(llm):
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=5, n=3,
                            structured=StructuredOutput.json_schema(SCHEMA))
    outs = llm.generate(["Describe a person.", "Another one:"], params)
    for out in outs:
        assert len(out.outputs) == 3
        for c in out.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema_rs.validate(SCHEMA, json.loads(c.text))
    assert_idle(llm)


def test_json_object_and_lark_grammars(llm):
    lark = 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]{1,3}/'
    outs = llm.generate(["Answer:"] * 4, [
        SamplingParams(max_tokens=40, temperature=1.0, seed=s, structured=StructuredOutput("lark", lark))
        for s in range(4)])
    for out in outs:
        text = out.outputs[0].text
        assert text in ("yes", "no") or (text.startswith("maybe ") and text[6:].isdigit()), text
    greedy = llm.generate("{", SamplingParams(max_tokens=300, temperature=0.0,
                                              structured=StructuredOutput("json_object")))[0].outputs[0]
    if greedy.finish_reason == "stop":  # a greedy random model may also write until max_tokens
        assert isinstance(json.loads(greedy.text), dict)
    else:
        assert greedy.text.startswith("{")
    assert_idle(llm)


def test_unconstrained_rows_are_unchanged_by_constrained_neighbours(llm):
    oracle = LLM(**{**ENGINE, "enable_prefix_caching": False})
    prompts = ["The scheduler admits", "Blocks are freed when", "A hash chain"]
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = [oracle.generate(p, plain)[0].outputs[0].token_ids for p in prompts]
    constrained = SamplingParams(max_tokens=60, temperature=1.0, seed=1,
                                 structured=StructuredOutput.json_schema(SCHEMA))
    mixed = llm.generate([prompts[0], "Person:", prompts[1], "Someone:", prompts[2]],
                         [plain, constrained, plain, constrained, plain])
    assert [mixed[i].outputs[0].token_ids for i in (0, 2, 4)] == alone
    assert_idle(llm)


@pytest.mark.parametrize("spec", [
    StructuredOutput("lark", "start: undefined_rule"),
    StructuredOutput("json_schema", "[1, 2]"),
    StructuredOutput("json_schema", "{not json"),
])
def test_a_grammar_that_cannot_compile_is_refused_before_anything_is_queued(llm, spec):
    with pytest.raises(InvalidRequestError) as info:
        llm.engine.add_request("bad", "hello", SamplingParams(structured=spec))
    assert info.value.param == "response_format"
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(InvalidRequestError):
        StructuredOutput("regex", "a+")


def test_a_grammar_owns_the_end_of_the_output():
    spec = StructuredOutput("json_object")
    for field, value in (("ignore_eos", True), ("min_tokens", 3)):
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(structured=spec, **{field: value})
        assert info.value.param == field


def test_bitmask_bias_matches_a_brute_force_loop():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 100, generator=gen)
    bitmasks = torch.randint(-2**31, 2**31 - 1, (2, 3), dtype=torch.int32, generator=gen)  # 96 ids
    bitmasks[0, 1] = -1  # a word of all ones: the sign bit is a token too
    rows = [3, 1]
    expected = logits.clone()
    for j, r in enumerate(rows):
        for t in range(100):
            word, bit = divmod(t, 32)
            if t >= 96 or not (int(bitmasks[j, word]) >> bit) & 1:
                expected[r, t] = float("-inf")
    add_bias(logits, rows, mask_bias(bitmasks))
    assert torch.equal(logits, expected)


def test_a_constraint_follows_the_output_list_forward_and_back(llm):
    tokenizer = llm.tokenizer
    compiler = GrammarCompiler(tokenizer.backend.to_str(), tokenizer.vocab_size,
                               sorted(tokenizer.eos_token_ids))
    spec = StructuredOutput.json_schema(SCHEMA)
    tokens = tokenizer.encode('{"name": "Al", "age": 7')
    words = (tokenizer.vocab_size + 31) // 32

    def mask(constraint, prefix):
        out = torch.zeros(words, dtype=torch.int32)
        constraint.fill(prefix, out)
        return out

    moving = compiler.constraint(spec)
    mask(moving, tokens)
    for cut in (len(tokens) - 1, 3, 0):
        assert torch.equal(mask(moving, tokens[:cut]), mask(compiler.constraint(spec), tokens[:cut]))


def test_a_row_whose_output_left_its_grammar_fails_alone(llm):
    tokenizer = llm.tokenizer
    compiler = GrammarCompiler(tokenizer.backend.to_str(), tokenizer.vocab_size,
                               sorted(tokenizer.eos_token_ids))
    bad = SamplingRow(SamplingParams(temperature=0.0), (), tokenizer.encode("not json"),
                      constraint=compiler.constraint(StructuredOutput.json_schema(SCHEMA)))
    good = SamplingRow(SamplingParams(temperature=0.0), (), ())
    logits = torch.randn(2, tokenizer.vocab_size, generator=torch.Generator().manual_seed(1))
    result = Sampler(tokenizer.vocab_size)(logits.clone(), [bad, good])
    assert result.token_ids[0] == -1 and isinstance(result.errors[0], InvalidRequestError)
    assert result.token_ids[1] == int(torch.argmax(logits[1])) and result.errors[1] is None
