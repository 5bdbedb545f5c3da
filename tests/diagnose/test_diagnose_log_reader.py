"""Request log parsing: both record shapes, salts, ordering, and clear errors."""
from __future__ import annotations

import json

import pytest

from prefixserve.diagnose.log_reader import LogFormatError, read_log


def write(tmp_path, lines):
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def test_bare_bodies_and_wrappers(tmp_path):
    path = write(tmp_path, [
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "cache_salt": "s1"},
        "",
        "# a comment",
        {"body": {"model": "m", "prompt": "once upon"}, "tenant": "acme", "request_id": "r2",
         "response": {"choices": [{"text": " a time"}], "usage": {"completion_tokens": 3}}},
        {"body": {"prompt": [5, 6, 7]}, "output_tokens": 4},
        {"body": {"prompt": ["a", "b"]}, "id": "batch"},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"},
                                                    {"type": "text", "text": "y"}]}]},
    ])
    records = read_log(path)
    assert [r.request_id for r in records] == ["line1", "r2", "line5", "batch#0", "batch#1", "line7"]
    assert records[0].is_chat and records[0].cache_salt == "s1" and records[0].tenant is None
    assert records[1].prompt == "once upon" and records[1].cache_salt == "acme"
    assert records[1].output_text == " a time" and records[1].output_tokens == 3
    assert records[2].prompt == [5, 6, 7] and records[2].output_tokens == 4
    assert records[5].messages[0]["content"] == "x\ny"   # text parts joined as the server joins them


def test_cache_salt_wins_over_tenant(tmp_path):
    path = write(tmp_path, [{"body": {"prompt": "p"}, "tenant": "t", "cache_salt": "s"}])
    assert read_log(path)[0].cache_salt == "s"


def test_timestamps_order_the_log_when_all_present(tmp_path):
    path = write(tmp_path, [{"body": {"prompt": "a"}, "timestamp": 20, "id": "late"},
                            {"body": {"prompt": "b"}, "timestamp": "1970-01-01T00:00:10Z", "id": "early"}])
    assert [r.request_id for r in read_log(path)] == ["early", "late"]
    path = write(tmp_path, [{"body": {"prompt": "a"}, "timestamp": 20, "id": "late"},
                            {"body": {"prompt": "b"}, "id": "untimed"}])
    assert [r.request_id for r in read_log(path)] == ["late", "untimed"]


@pytest.mark.parametrize("line, message", [
    ("{not json", "not valid JSON"),
    ('[1, 2]', "must be a JSON object"),
    ('{"model": "m"}', "neither 'messages'"),
    ('{"messages": []}', "non-empty list"),
    ('{"prompt": "x", "cache_salt": ""}', "cache_salt"),
    ('{"prompt": [1, -2]}', "token ids"),
    ('{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "an image part as the client sent"),
    ('{"messages": [{"role": "user", "content": [{"type": "image", "prefixserve_image": {"hash": "ab"}}]}]}',
     "prefixserve_image.hash must be 32 hex"),
    ('{"messages": [{"role": "user", "content": [{"type": "audio"}]}]}', "only text parts"),
    ('{"prompt": "x", "timestamp": "yesterday"}', "timestamp"),
])
def test_bad_lines_name_the_line_and_problem(tmp_path, line, message):
    path = write(tmp_path, ['{"prompt": "ok"}', line])
    with pytest.raises(LogFormatError, match=message) as info:
        read_log(path)
    assert ":2" in str(info.value)


def test_missing_and_empty_logs(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_log(tmp_path / "nope.jsonl")
    with pytest.raises(LogFormatError, match="no requests"):
        read_log(write(tmp_path, [""]))


@pytest.mark.parametrize("system", [
    "You are the Contoso help desk. Answer briefly.",
    [{"type": "text", "text": "You are the Contoso help desk. "},
     {"type": "text", "text": "Answer briefly.", "cache_control": {"type": "ephemeral"}}],
])
def test_an_anthropic_log_keeps_its_system_prompt(tmp_path, system):
    from prefixserve.diagnose import load_renderer
    turns = [{"role": "user", "content": "My printer is offline."},
             {"role": "assistant", "content": "Is it plugged in?"},
             {"role": "user", "content": [{"type": "text", "text": "Yes, and the light is on."}]}]
    # the server joins a message's text blocks with newlines
    system_text = system if isinstance(system, str) else "\n".join(block["text"] for block in system)
    openai_messages = [{"role": "system", "content": system_text},
                       *[{**t, "content": t["content"] if isinstance(t["content"], str) else t["content"][0]["text"]}
                         for t in turns]]
    anthropic_log = write(tmp_path, [{"body": {"model": "m", "max_tokens": 8, "system": system, "messages": turns}}])
    openai_path = tmp_path / "openai.jsonl"
    openai_path.write_text(json.dumps({"body": {"model": "m", "messages": openai_messages}}) + "\n")
    renderer = load_renderer("random:qwen3-tiny")
    # The oracle: the chat template itself, given the conversation in OpenAI's form.
    expected = renderer.tokenizer.apply_chat_template(openai_messages, tokenize=True)
    [from_anthropic], [from_openai] = read_log(anthropic_log), read_log(openai_path)
    assert from_anthropic.messages == openai_messages
    assert renderer.render(from_anthropic).token_ids == expected
    assert renderer.render(from_openai).token_ids == expected


def test_a_system_that_is_not_text_is_refused_naming_it(tmp_path):
    path = write(tmp_path, [{"body": {"model": "m", "system": 7, "messages": [{"role": "user", "content": "hi"}]}}])
    with pytest.raises(LogFormatError, match="'system'"):
        read_log(path)


def test_the_body_model_is_kept(tmp_path):
    path = write(tmp_path, [{"body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}},
                            {"prompt": "hi"}])
    assert [r.model for r in read_log(path)] == ["gpt-4o-mini", None]
