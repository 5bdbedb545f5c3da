"""prefixserve.prompt's renderer: spans against brute force, and spans and breakpoints of one
conversation agreeing with each other.

Oracles, independent of the renderer's binary-search common prefixes and token offsets:
- message k ends where the rendering stops depending on what follows it: the smallest first
  difference (a naive loop) between the prompt and renderings of the turns up to k followed by
  nothing, or by a probe message;
- the tools are what the rendering without tools lacks: cutting their span out gives exactly
  that rendering, and it holds every tool's JSON;
- a character boundary is the largest number of leading tokens whose decoded text is a prefix
  of the text before it.
"""
from __future__ import annotations

import json
import random

import pytest

from prefixserve.prompt import (GENERATION_PROMPT, HISTORY, NEW_TURN, SYSTEM, TOOLS, CacheControl,
                                Conversation, Part, PromptRenderer, Tool, Turn)
from prefixserve.tokenizer import load_tokenizer

WORDS = ["cache", "block", "prefix", "évict", "naïve", "东京", "😀", "x=1;", "(a, b)", "end.",
         "  ", "\n", "\t", "pins", "TTL", "don't", "42", "...", "<b>", "\\n"]
PROBE = Conversation([Turn({"role": "user"}, [Part("probe")])])


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("random:qwen3-tiny")


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(WORDS) + rng.choice(["", " ", "\n"]) for _ in range(n)) or "x"


def random_parts(rng: random.Random, where: str) -> list[Part]:
    return [Part(random_text(rng, rng.randrange(1, 10)), None, f"{where}.content[{j}]")
            for j in range(rng.randrange(1, 3))]


def random_conversation(rng: random.Random) -> Conversation:
    """Tools, a system prompt, and user, assistant, tool-call and tool-result turns, with up to
    four random cache_control marks."""
    tools = [Tool({"type": "function", "function": {"name": f"tool_{i}", "description": random_text(rng, 3),
                                                   "parameters": {"type": "object"}}}, None, f"tools[{i}]")
             for i in range(rng.randrange(0, 3))]
    turns = []
    if rng.random() < 0.7:
        turns.append(Turn({"role": "system"}, random_parts(rng, "system")))
    for _ in range(rng.randrange(1, 6)):
        where = f"messages[{len(turns)}]"
        kind = rng.choice(["user", "user", "assistant", "call", "tool"])
        if kind == "call":
            turns.append(Turn({"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "tool_0", "arguments": json.dumps({"q": random_text(rng, 2)})}}]}, None))
        elif kind == "tool":
            turns.append(Turn({"role": "tool", "tool_call_id": "c1"}, random_parts(rng, where)))
        else:
            turns.append(Turn({"role": kind}, random_parts(rng, where)))
    elements = tools + [p for t in turns for p in t.parts or ()]
    for element in rng.sample(elements, min(len(elements), rng.randrange(0, 5))):
        element.cache_control = CacheControl(rng.choice(["5m", "1h"]))
    return Conversation(turns, tools)


def first_difference(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def oracle_tokens(tokenizer, token_ids: list[int], text: str, offset: int) -> int:
    before = text[:offset]
    return max(j for j in range(len(token_ids) + 1)
               if before.startswith(tokenizer.decode(token_ids[:j], skip_special_tokens=False)))


def oracle_spans(tokenizer, renderer: PromptRenderer, conv: Conversation, text: str,
                 token_ids: list[int]) -> list[tuple]:
    pieces, start = [], 0
    last = len(conv.turns) - 1
    for k, turn in enumerate(conv.turns):
        head = Conversation(conv.turns[:k + 1], conv.tools)
        end = max(start, min(first_difference(text, renderer.render_text(head, generation=False)),
                             first_difference(text, renderer.render_text(head.then(PROBE)))))
        kind = SYSTEM if k == 0 and turn.fields["role"] == "system" else NEW_TURN if k == last else HISTORY
        pieces.append((start, end, kind, k))
        start = end
    pieces.append((start, len(text), GENERATION_PROMPT, None))
    if conv.tools:
        without = renderer.render_text(conv, tools=[])
        lo = first_difference(text, without)
        hi = len(text) - min(first_difference(text[::-1], without[::-1]), len(without) - lo)
        assert text[:lo] + text[hi:] == without
        assert all(json.dumps(t.spec, ensure_ascii=False) in text[lo:hi] for t in conv.tools)
        cut = []
        for s, e, kind, k in pieces:
            if e <= lo or s >= hi:
                cut.append((s, e, kind, k))
                continue
            if s < lo:
                cut.append((s, lo, kind, k))
            if not cut or cut[-1][2] != TOOLS:
                cut.append((lo, hi, TOOLS, None))
            if e > hi:
                cut.append((hi, e, kind, k))
        pieces = cut
    out = []
    for s, e, kind, k in pieces:
        ts, te = (oracle_tokens(tokenizer, token_ids, text, c) for c in (s, e))
        if te > ts:
            out.append((kind, ts, te, k, conv.turns[k].fields["role"] if k is not None else None))
    return out


@pytest.mark.parametrize("seed", range(30))
def test_spans_match_brute_force(tokenizer, seed):
    rng = random.Random(seed)
    conv = random_conversation(rng)
    renderer = PromptRenderer(tokenizer, add_generation_prompt=rng.random() < 0.8)
    rendered = renderer.render(conv)
    spans = rendered.spans
    assert spans[0].start == 0 and spans[-1].end == len(rendered.token_ids)
    assert all(a.end == b.start for a, b in zip(spans, spans[1:]))
    assert [(s.kind, s.start, s.end, s.message_index, s.role) for s in spans] == oracle_spans(
        tokenizer, renderer, conv, rendered.text, rendered.token_ids)


@pytest.mark.parametrize("seed", range(40))
def test_breakpoints_agree_with_spans(tokenizer, seed):
    """A mark ends inside the span of its own element: a tool's in the tools' span, a part's in
    its message's span, or in the tools' span when the template renders the tools after that
    message's text (a mark covers every tool: tools -> system -> messages). A mark on a
    message's last part is the span's end but for the message's closing template text, which
    no content changes."""
    rng = random.Random(1000 + seed)
    conv = random_conversation(rng)
    renderer = PromptRenderer(tokenizer)
    rendered = renderer.render(conv)
    spans = rendered.spans
    where_of = {p.where: (i, j, len(t.parts) - 1) for i, t in enumerate(conv.turns)
                for j, p in enumerate(t.parts or ())}
    for b in rendered.breakpoints:
        holder = next(s for s in spans if s.start < b.num_tokens <= s.end)
        if b.where.startswith("tools"):
            assert holder.kind == TOOLS, b
            continue
        i, j, last = where_of[b.where]
        own = [s for s in spans if s.message_index == i]
        if holder.kind == TOOLS:  # the tools come before every message in the marks' order
            assert holder.start >= own[0].start, b
            continue
        assert holder.message_index == i, b
        if j == last:
            part = conv.turns[i].parts[j]
            part.text += " zz"
            again = renderer.render(conv)
            part.text = part.text[:-3]
            (b2,) = [x for x in again.breakpoints if x.where == b.where]
            holder2 = next(s for s in again.spans if s.start < b2.num_tokens <= s.end)
            assert closing(tokenizer, rendered, b, holder) == closing(tokenizer, again, b2, holder2), b


def closing(tokenizer, rendered, b, span) -> str:
    """The text from a breakpoint to the end of the span holding it."""
    end = len(tokenizer.decode(rendered.token_ids[:span.end], skip_special_tokens=False))
    return rendered.text[b.char_offset:end]


def test_spans_are_located_only_when_asked(tokenizer):
    calls = []
    renderer = PromptRenderer(tokenizer)
    render = renderer.tokenizer.apply_chat_template

    class Counting:
        encoding = tokenizer.encoding

        def apply_chat_template(self, *args, **kwargs):
            calls.append(kwargs["add_generation_prompt"])
            return render(*args, **kwargs)

    renderer.tokenizer = Counting()
    conv = Conversation.of_messages([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    rendered = renderer.render(conv)
    assert calls == [True]
    assert [s.kind for s in rendered.spans] == [SYSTEM, NEW_TURN, GENERATION_PROMPT]
    assert calls == [True, False, False]
    renderer.render(conv).spans  # the partial renderings are remembered
    assert calls == [True, False, False, True]


def test_a_template_refusing_partial_conversations_merges_the_message_into_the_next(tokenizer):
    strict = ("{% if messages[-1].role == 'assistant' %}{{ raise_exception('ends with assistant') }}{% endif %}"
              "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")
    renderer = PromptRenderer(tokenizer, add_generation_prompt=False, template_kwargs={"chat_template": strict})
    conv = Conversation.of_messages([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                     {"role": "user", "content": "c"}])
    rendered = renderer.render(conv)
    assert [(s.kind, s.message_index) for s in rendered.spans] == [(HISTORY, 0), (NEW_TURN, 2)]
    assert rendered.spans[-1].end == len(rendered.token_ids)


def test_plain_messages_render_as_given(tokenizer):
    messages = [{"role": "system", "content": "rules"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "42"}]},
                {"role": "user", "content": "thanks"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    rendered = PromptRenderer(tokenizer).render(Conversation.of_messages(messages, tools))
    assert rendered.token_ids == tokenizer.apply_chat_template(messages, tools=tools, tokenize=True)
    assert [s.kind for s in rendered.spans] == [SYSTEM, TOOLS, SYSTEM, HISTORY, HISTORY, HISTORY,
                                                NEW_TURN, GENERATION_PROMPT]
