"""cache_control breakpoints -> token counts, checked against brute force.

Oracles, independent of the sentinel / common-prefix method under test:
- a text part ends where the rendered prompt first changes when the part's last character
  changes (first differing index + 1);
- a tool ends where its JSON (as json.dumps writes it) ends in the rendered prompt; the located
  end may only add the separator whitespace that follows every tool;
- a breakpoint's token count is the largest j such that the decoded first j tokens are a
  prefix of the text before the breakpoint.
"""
from __future__ import annotations

import json
import random

import pytest

from prefixserve.errors import CacheControlError
from prefixserve.prompt import (CacheControl, Conversation, Part, PromptRenderer, Tool, Turn,
                                parse_cache_control)
from prefixserve.tokenizer import load_tokenizer

CC = CacheControl()
WORDS = ["cache", "block", "prefix", "évict", "naïve", "东京", "😀", "x=1;", "(a, b)", "end.",
         "  ", "\n", "\t", "pins", "TTL", "don't", "42", "1h", "...", "<b>", "\\n"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("random:qwen3-tiny")


def random_text(rng: random.Random, n: int) -> str:
    text = "".join(rng.choice(WORDS) + rng.choice(["", " ", " ", "\n"]) for _ in range(n))
    return text or "x"


def random_conversation(rng: random.Random, max_marks: int = 4) -> Conversation:
    tools = [Tool({"type": "function", "function": {"name": f"tool_{i}", "description": random_text(rng, 3),
                                                   "parameters": {"type": "object"}}}, None, f"tools[{i}]")
             for i in range(rng.randrange(0, 3))]
    turns = []
    if rng.random() < 0.7:
        turns.append(Turn({"role": "system"}, [Part(random_text(rng, rng.randrange(1, 12)), None, f"system[{j}]")
                                               for j in range(rng.randrange(1, 3))]))
    for i in range(rng.randrange(1, 4)):
        role = "user" if i % 2 == 0 else "assistant"
        turns.append(Turn({"role": role}, [Part(random_text(rng, rng.randrange(1, 10)), None,
                                                f"messages[{i}].content[{j}]")
                                           for j in range(rng.randrange(1, 3))]))
    elements = tools + [p for t in turns for p in t.parts]
    for element in rng.sample(elements, min(len(elements), rng.randrange(1, max_marks + 1))):
        element.cache_control = CacheControl(rng.choice(["5m", "1h"]))
    return Conversation(turns, tools)


def first_difference(a: str, b: str) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


def oracle_part_end(renderer: PromptRenderer, conv: Conversation, part: Part, text: str) -> int:
    original = part.text
    part.text = original[:-1] + ("b" if original[-1:] != "b" else "c")
    try:
        changed = renderer.render_text(conv)
    finally:
        part.text = original
    return first_difference(text, changed) + 1


def oracle_tool_end(tool: Tool, text: str) -> int:
    rendered = json.dumps(tool.spec, ensure_ascii=False)
    assert text.count(rendered) == 1
    return text.index(rendered) + len(rendered)


def oracle_tokens(tokenizer, token_ids: list[int], text: str, offset: int) -> int:
    before = text[:offset]
    return max(j for j in range(len(token_ids) + 1)
               if before.startswith(tokenizer.decode(token_ids[:j], skip_special_tokens=False)))


@pytest.mark.parametrize("seed", range(40))
def test_breakpoints_match_brute_force(tokenizer, seed):
    rng = random.Random(seed)
    conv = random_conversation(rng)
    renderer = PromptRenderer(tokenizer)
    rendered = renderer.render(conv)
    text = rendered.text
    assert rendered.token_ids == tokenizer.apply_chat_template(
        [t.template_message() for t in conv.turns], tools=[t.spec for t in conv.tools] or None,
        tokenize=True)
    tools_end = oracle_tool_end(conv.tools[-1], text) if conv.tools else 0
    by_where = {b.where: b for b in rendered.breakpoints}
    assert [b.where for b in rendered.breakpoints] == [w for w, _ in conv.marks()]
    for tool in conv.tools:
        if tool.cache_control is None:
            continue
        b = by_where[tool.where]
        expected = oracle_tool_end(tool, text)
        assert b.char_offset >= expected and text[expected:b.char_offset].strip() == "", tool.where
        assert b.num_tokens == oracle_tokens(tokenizer, rendered.token_ids, text, b.char_offset)
    for turn in conv.turns:
        for part in turn.parts:
            if part.cache_control is None:
                continue
            b = by_where[part.where]
            end = oracle_part_end(renderer, conv, part, text)
            assert text[:end].endswith(part.text)
            if end >= tools_end:
                assert b.char_offset == end, part.where
            else:  # tools come before the system in the tools -> system -> messages order
                assert b.char_offset >= tools_end and text[tools_end:b.char_offset].strip() == ""
            assert b.num_tokens == oracle_tokens(tokenizer, rendered.token_ids, text, b.char_offset)
            assert b.ttl == part.cache_control.ttl


def test_breakpoint_prefix_is_stable_when_later_content_changes(tokenizer):
    rng = random.Random(7)
    renderer = PromptRenderer(tokenizer)
    doc = random_text(rng, 200)
    for tail in ("What does it say?", "Summarise it.\n", "😀"):
        conv = Conversation([Turn({"role": "system"}, [Part(doc, CC, "system[0]")]),
                             Turn({"role": "user"}, [Part(tail, None, "messages[0].content[0]")])])
        rendered = renderer.render(conv)
        k = rendered.breakpoints[0].num_tokens
        alone = renderer.render(Conversation([Turn({"role": "system"}, [Part(doc, None, "s")])]))
        assert rendered.token_ids[:k] == alone.token_ids[:k]
        assert k >= len(tokenizer.encode(doc))  # the whole document is inside the prefix


def test_more_than_four_breakpoints_is_an_error(tokenizer):
    parts = [Part(f"part {j}", CC, f"messages[0].content[{j}]") for j in range(5)]
    conv = Conversation([Turn({"role": "user"}, parts)])
    with pytest.raises(CacheControlError, match="at most 4") as info:
        PromptRenderer(tokenizer).render(conv)
    assert info.value.param == "messages[0].content[4].cache_control"


@pytest.mark.parametrize("raw, message", [
    ({"type": "persistent"}, "ephemeral"),
    ({"type": "ephemeral", "ttl": "10m"}, "5m"),
    ({"type": "ephemeral", "scope": "x"}, "unknown fields"),
    ("ephemeral", "must be an object"),
])
def test_bad_cache_control_is_rejected_with_its_location(raw, message):
    with pytest.raises(CacheControlError, match=message) as info:
        parse_cache_control(raw, "system[1]")
    assert info.value.param == "system[1].cache_control"


def test_template_that_rewrites_marked_text_is_reported(tokenizer):
    stripping = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n"
                 "{% endfor %}")
    renderer = PromptRenderer(tokenizer, template_kwargs={"chat_template": stripping})
    conv = Conversation([Turn({"role": "user"}, [Part("padded text  ", CC, "messages[0].content[0]")])])
    with pytest.raises(CacheControlError, match="changes the text"):
        renderer.render(conv)


def test_template_without_tools_places_tool_marks_at_zero(tokenizer):
    no_tools = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    renderer = PromptRenderer(tokenizer, template_kwargs={"chat_template": no_tools})
    conv = Conversation([Turn({"role": "user"}, [Part("hello there", None, "m")])],
                        [Tool({"type": "function", "function": {"name": "f"}}, CC, "tools[0]")])
    (b,) = renderer.render(conv).breakpoints
    assert (b.char_offset, b.num_tokens) == (0, 0)
