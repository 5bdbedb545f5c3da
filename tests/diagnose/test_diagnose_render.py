"""The span map: contiguous, covering, and each span holding its own message's text."""
from __future__ import annotations

from prefixserve.diagnose import load_renderer
from prefixserve.diagnose.log_reader import LogRecord
from diagnose_logs import STABLE, TOOLS, assistant, sys, user


def test_spans_cover_the_prompt_and_hold_their_messages():
    renderer = load_renderer("random:qwen3-tiny")
    tok = renderer.tokenizer
    messages = [sys(STABLE), user("first question"), assistant("first answer"),
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "lookup_ticket", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "ticket 7 is open"},
                user("second question")]
    record = LogRecord("r", 1, messages=messages, tools=TOOLS)
    rendered = renderer.render(record)
    assert rendered.token_ids == tok.apply_chat_template(messages, tools=TOOLS, tokenize=True)
    spans = rendered.spans
    assert spans[0].start == 0 and spans[-1].end == len(rendered.token_ids)
    assert all(a.end == b.start for a, b in zip(spans, spans[1:]))

    def text(span):
        return tok.decode(rendered.token_ids[span.start:span.end], skip_special_tokens=False)

    assert STABLE.splitlines()[0] in text(rendered.span_of("system"))
    tools_text = text(rendered.span_of("tools"))
    assert all(t["function"]["name"] in tools_text for t in TOOLS)
    assert "first question" in text(rendered.span_of("history", 1))
    assert "first answer" in text(rendered.span_of("history", 2))
    assert "lookup_ticket" in text(rendered.span_of("history", 3))
    assert "ticket 7 is open" in text(rendered.span_of("history", 4))
    new_turn = rendered.span_of("new-turn")
    assert "second question" in text(new_turn) and new_turn.message_index == 5
    assert text(rendered.span_of("generation-prompt")).startswith("<|im_start|>assistant")
    assert rendered.span_at(new_turn.start).label == "new user turn (message 5)"


def test_completion_prompts():
    renderer = load_renderer("random:qwen3-tiny")
    text = renderer.render(LogRecord("a", 1, prompt="hello there"))
    assert text.token_ids == renderer.tokenizer.encode("hello there", add_special_tokens=True)
    ids = renderer.render(LogRecord("b", 2, prompt=[4, 5, 6], output_tokens=2))
    assert ids.token_ids == [4, 5, 6] and ids.spans[0].label == "prompt"
    assert len(ids.output_token_ids) == 2
