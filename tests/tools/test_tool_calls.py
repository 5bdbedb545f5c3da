"""Tool-call parsing on text (finished and streamed) and the grammars that force a call.

Oracles: the call objects each text was built from (json.dumps of known names and arguments),
the finished-text parser for every way of cutting the same text into stream deltas, and the
JSON schema (jsonschema_rs) for whatever a grammar lets through when every token is drawn at
random from its mask.
"""
from __future__ import annotations

import json
import random

import jsonschema_rs
import llguidance
import pytest
import torch
from hypothesis import given, settings, strategies as st

from prefixserve.entrypoints.server.anthropic.tool_stream import BlockStream
from prefixserve.entrypoints.server.anthropic.tools import reply
from prefixserve.entrypoints.server.tools import ChatTools
from prefixserve.errors import InvalidRequestError
from prefixserve.structured.grammar import GrammarCompiler
from prefixserve.tokenizer import load_tokenizer
from prefixserve.tools import ToolCallStream, format_of_template, parse_tool_calls
from prefixserve.tools.choice import ToolChoice, call_grammar, tool_choice_of, tool_specs_of

CALLS = [("get_weather", {"city": "Paris", "nested": {"a": [1, 2, {"b": "}"}]}, "s": "</tool_call>?"}),
         ("get_time", {}),
         ("search", {"q": "a;b \"quoted\" \\ back", "n": 1.50})]


def qwen_text(calls, before="Let me look.", spacing=", ") -> str:
    body = "\n".join("<tool_call>\n" + '{"name": ' + json.dumps(name) + ', "arguments": '
                     + json.dumps(args, separators=(spacing, ": ")) + "}\n</tool_call>" for name, args in calls)
    return (before + "\n" if before else "") + body


def test_qwen_calls_parse_into_their_names_and_exact_argument_text():
    for spacing in (", ", ","):
        content, calls = parse_tool_calls(qwen_text(CALLS, spacing=spacing), "qwen")
        assert content == "Let me look."
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [(n, a) for n, a in CALLS]
        # the text as written (spacing, "1.50") is kept, never re-serialised
        assert [c.arguments for c in calls] == [json.dumps(a, separators=(spacing, ": ")) for _, a in CALLS]
        assert len({c.id for c in calls}) == len(calls)


def test_text_without_calls_or_with_a_broken_call_stays_content():
    assert parse_tool_calls("just words", "qwen") == ("just words", [])
    broken = 'x <tool_call>\n{"name": "f", "arguments": {"a": }\n</tool_call>'
    assert parse_tool_calls(broken, "qwen") == (broken, [])
    content, calls = parse_tool_calls(broken + "\n" + qwen_text(CALLS[1:2], before=""), "qwen")
    assert [c.name for c in calls] == ["get_time"] and broken.strip() in content


def test_llama3_json_calls_parse_with_separators_inside_strings():
    text = "<|python_tag|>" + "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in CALLS)
    content, calls = parse_tool_calls(text, "llama3")
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(n, a) for n, a in CALLS]
    assert parse_tool_calls("The answer is {42}.", "llama3") == ("The answer is {42}.", [])
    assert format_of_template("{{ '<|python_tag|>' }} ipython") == "llama3"
    assert format_of_template("<tool_call>") == "qwen" and format_of_template(None) == "qwen"


def replay(fmt: str, text: str, cuts: list[int]):
    stream = ToolCallStream(fmt)
    events = []
    for cut in sorted(set(cuts)):
        events += stream.feed(text[:cut])
    events += stream.finish(text)
    content = "".join(e.text for e in events if e.kind == "content")
    starts = [(e.index, e.name, e.id) for e in events if e.kind == "start"]
    args: dict[int, str] = {}
    for e in events:
        if e.kind == "args":
            args[e.index] = args.get(e.index, "") + e.text
    return content, starts, args


def llama3_text(calls, lead="", spacing=", ", typed=False, after="") -> str:
    """Llama 3 calls as the model writes them: name first (`"type": "function"` before it, as
    Llama 3.2 may), `;` between them."""
    def one(name, args):
        head = '{"type": "function", ' if typed else "{"
        return (head + '"name": ' + json.dumps(name) + ', "parameters": '
                + json.dumps(args, separators=(spacing, ": ")) + "}")
    return lead + "; ".join(one(n, a) for n, a in calls) + after


# Llama 3 outputs that are not calls, though some start like one
LLAMA3_CONTENT = ['{"answer": 42}', '{"name": 3, "parameters": {}}', '{"parameters": {}, "name": "f"}',
                  '{42}', "plain < text", '  {"name": "f", "parameters": [1]}', "<|python_tag|>print(1)"]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_cut_of_the_stream_assembles_into_the_finished_parse(data):
    """Any cut of the stream into deltas, of any output (calls, content that looks like calls,
    both, an output that max_tokens ended anywhere) gives the finished parse's content, calls
    and argument texts."""
    fmt = data.draw(st.sampled_from(["qwen", "llama3"]))
    chosen = data.draw(st.lists(st.sampled_from(CALLS), min_size=0, max_size=3))
    if fmt == "qwen":
        text = qwen_text(chosen, before=data.draw(st.sampled_from(["", "Sure <tool", "a < b"])))
    elif chosen:
        text = llama3_text(chosen, lead=data.draw(st.sampled_from(["", "<|python_tag|>", " \n"])),
                           spacing=data.draw(st.sampled_from([", ", ","])), typed=data.draw(st.booleans()),
                           after=data.draw(st.sampled_from(["", "  ", "\n\nDone; {ok}", "; {\"name\": 3}"])))
    else:
        text = data.draw(st.sampled_from(LLAMA3_CONTENT))
    if data.draw(st.booleans()):  # max_tokens ended the output
        text = text[:data.draw(st.integers(0, len(text)))]
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=40))
    content, starts, args = replay(fmt, text, cuts)
    want_content, want_calls = parse_tool_calls(text, fmt)
    assert [name for _, name, _ in starts] == [c.name for c in want_calls]
    assert [i for i, _, _ in starts] == list(range(len(want_calls)))
    assert [args.get(i, "") for i in range(len(want_calls))] == [c.arguments for c in want_calls]
    assert content.strip() == (want_content or "").strip()


def test_llama3_calls_stream_their_name_and_arguments_as_they_are_written():
    text = llama3_text(CALLS[:2], lead="<|python_tag|>")
    stream = ToolCallStream("llama3")
    first_args = text.index('"parameters": ') + len('"parameters": ')
    assert stream.feed(text[:first_args - 3]) == []  # the header may still be content's start
    start, brace = stream.feed(text[:first_args + 1])
    assert (start.kind, start.name, start.index) == ("start", "get_weather", 0)
    assert (brace.kind, brace.text) == ("args", "{")
    (fragment,) = stream.feed(text[:first_args + 10])
    assert (fragment.kind, fragment.text) == ("args", text[first_args + 1:first_args + 10])
    later = stream.finish(text)
    assert [e.name for e in later if e.kind == "start"] == ["get_time"]
    assert all(e.kind != "content" for e in later)
    assert [c.arguments for c in stream.calls] == [json.dumps(a) for _, a in CALLS[:2]]


def test_llama3_content_that_starts_like_json_streams_as_content_once_it_cannot_be_a_call():
    text = '{"answer": "a long reply in JSON", "more": [1, 2, 3]}'
    stream = ToolCallStream("llama3")
    assert stream.feed(text[:2]) == []  # '{"' may still begin a call
    (event,) = stream.feed(text[:5])
    assert (event.kind, event.text) == ("content", text[:5])
    assert [e.text for e in stream.feed(text[:20])] == [text[5:20]]
    assert "".join(e.text for e in stream.finish(text)) == text[20:]
    assert stream.calls == []


def test_an_output_that_ends_inside_a_call_is_a_cut_call_with_the_arguments_written():
    for fmt, text in (("qwen", qwen_text(CALLS[:1])), ("llama3", llama3_text(CALLS[:1]))):
        whole = json.dumps(CALLS[0][1])
        at = text.index(whole) + 20
        content, (call,) = parse_tool_calls(text[:at], fmt)
        assert (call.name, call.arguments, call.complete) == ("get_weather", whole[:20], False)
        assert content == ("Let me look." if fmt == "qwen" else None)
        # the arguments closed but not the call: complete arguments, the call still cut short
        at = text.index(whole) + len(whole)
        (call,) = parse_tool_calls(text[:at], fmt)[1]
        assert (call.arguments, call.complete) == (whole, False)
        (call,) = parse_tool_calls(text[:at + 1], fmt)[1]
        assert (call.arguments, call.complete) == (whole, True)


def test_every_character_as_its_own_delta():
    text = qwen_text(CALLS)
    content, starts, args = replay("qwen", text, list(range(len(text) + 1)))
    assert content.strip() == "Let me look."
    assert [args[i] for i in range(3)] == [c.arguments for c in parse_tool_calls(text, "qwen")[1]]


def test_tool_choice_and_tools_are_checked():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    specs = tool_specs_of(tools)
    assert tool_choice_of(None, specs).mode == "auto"
    assert tool_choice_of(None, []).mode == "none"
    assert tool_choice_of({"type": "any", "disable_parallel_tool_use": True}, specs).parallel is False
    assert tool_choice_of({"type": "function", "function": {"name": "f"}}, specs).name == "f"
    bad = [(lambda: tool_choice_of("required", []), "tool_choice"),
           (lambda: tool_choice_of({"type": "tool", "name": "g"}, specs), "tool_choice"),
           (lambda: tool_choice_of(3, specs), "tool_choice"),
           (lambda: tool_specs_of([{"type": "function", "function": {"name": "a\"b"}}]), "tools[0].function.name"),
           (lambda: tool_specs_of(tools + tools), "tools[1].function.name"),
           (lambda: tool_specs_of([{"type": "retrieval"}]), "tools[0]")]
    for call, param in bad:
        with pytest.raises(InvalidRequestError) as info:
            call()
        assert info.value.param == param


SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2}},
    "required": ["city", "days"], "additionalProperties": False}
# (a free-form object would let uniformly drawn tokens nest and grow for ever)
NOOP = {"type": "object", "properties": {}, "additionalProperties": False}


@pytest.mark.parametrize("fmt", ["qwen", "llama3"])
@pytest.mark.parametrize("parallel", [True, False])
def test_forced_call_grammar_only_lets_valid_calls_through(fmt, parallel):
    tokenizer = load_tokenizer("random:qwen3-tiny")
    specs = tool_specs_of([{"type": "function", "function": {"name": "weather", "parameters": SCHEMA}},
                           {"type": "function", "function": {"name": "noop", "parameters": NOOP}}])
    choice = tool_choice_of("required", specs, parallel=parallel)

    def single(text):
        ids = tokenizer.encode(text)
        return ids[0] if len(ids) == 1 else None

    grammar = call_grammar(choice, specs, fmt, single)
    compiler = GrammarCompiler(tokenizer.backend.to_str(), tokenizer.vocab_size,
                               sorted(tokenizer.eos_token_ids))
    rng = random.Random(0)
    for _ in range(12):
        constraint = compiler.constraint(grammar)
        tokens: list[int] = []
        mask = torch.zeros((1, (tokenizer.vocab_size + 31) // 32), dtype=torch.int32)
        while len(tokens) < 400:
            constraint.fill(tokens, mask[0])
            bits = ((mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()
            allowed = bits[:tokenizer.vocab_size].nonzero().flatten().tolist()
            token = rng.choice(allowed)
            if token in tokenizer.eos_token_ids:
                break
            tokens.append(token)
        else:
            pytest.fail("the grammar never allowed the end of the output")
        content, calls = parse_tool_calls(tokenizer.decode(tokens), fmt)
        assert content is None and calls and (parallel or len(calls) == 1)
        for call in calls:
            jsonschema_rs.validate(SCHEMA if call.name == "weather" else NOOP, call.input())


def test_a_schema_llguidance_cannot_compile_is_refused_with_its_reason():
    tokenizer = load_tokenizer("random:qwen3-tiny")
    compiler = GrammarCompiler(tokenizer.backend.to_str(), tokenizer.vocab_size, [tokenizer.eos_token_id])
    from prefixserve.structured import StructuredOutput
    with pytest.raises(InvalidRequestError) as info:
        compiler.constraint(StructuredOutput("lark", "start: undefined_rule"))
    assert info.value.param == "response_format" and "compiled" in str(info.value)
    assert llguidance.__version__


@pytest.mark.parametrize("fmt, text", [
    ("llama3", llama3_text(CALLS[:2], after="\nDone.")),
    ("qwen", qwen_text(CALLS[:2], before="Looking it up.")),
])
def test_anthropic_blocks_of_a_finished_output_come_in_the_order_its_stream_sends_them(fmt, text):
    tools = ChatTools([], ToolChoice("auto"), fmt, None)
    blocks, called = reply(tools, text)
    stream = BlockStream(tools.choice, fmt)
    started = [json.loads(event.split("data: ", 1)[1]) for event in stream.begin() + stream.feed(text, True)]
    kinds = [e["content_block"]["type"] for e in started if e["type"] == "content_block_start"]
    assert called and [b["type"] for b in blocks] == kinds
