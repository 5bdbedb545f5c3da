"""The built-in tokenizer written in HF layout behaves exactly like transformers' AutoTokenizer on it:
same ids, same decoded text, same chat-template text and ids (transformers is the oracle)."""
from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from prefixserve.tokenizer import ChatTemplateError, Tokenizer, write_builtin_tokenizer_files

TEXTS = [
    "",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "Numbers 1234567890 and 3.14159, -42, 1e-5.",
    "def f(x):\n    return x ** 2\n\n\nprint(f(3))\t# tab",
    "Ünïcödé: naïve café, Straße, Ελληνικά, русский, עברית, العربية",
    "中文文本和日本語のテキスト、한국어 텍스트",
    "Emoji 😀👍🏽👨‍👩‍👧‍👦🇯🇵 and symbols ∑∫√π€",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\n<tool_call>x</tool_call>",
    "<|endoftext|><|endoftext|>text after",
    "\r\n\r\nwindows\r\nlines\n\n\n   \n",
    "a" * 300,
    "I'm sure they've done it; we'll see. DON'T SHOUT",
]

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city (°C).",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                         "unit": {"type": "string", "enum": ["c", "f"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search <the web> & more",
                                      "parameters": {"type": "object", "properties": {}}}},
]

CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "Hi there"}],
    "system_user_assistant": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3? Réponds en français 😀"},
    ],
    "tool_calls": [
        {"role": "system", "content": "Use tools when needed."},
        {"role": "user", "content": "Weather in Paris and Tokyo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "東京", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "c0", "content": '{"temp": 14}'},
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 9}'},
        {"role": "assistant", "content": "Paris 14 °C, Tokyo 9 °C."},
        {"role": "user", "content": "Thanks"},
    ],
    "content_with_tool_call_and_none": [
        {"role": "user", "content": "Search it"},
        {"role": "assistant", "content": "Let me search.", "tool_calls": [
            {"type": "function", "function": {"name": "search", "arguments": {}}}]},
        {"role": "tool", "content": "no results"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "search", "arguments": {"q": "again"}}}]},
    ],
    "reasoning": [
        {"role": "user", "content": "Old question"},
        {"role": "assistant", "content": "Old answer", "reasoning_content": "old thoughts"},
        {"role": "user", "content": "New question"},
        {"role": "assistant", "content": "New answer", "reasoning_content": "\nnew thoughts\n"},
    ],
    "content_parts_and_other_role": [
        {"role": "developer", "content": "Be kind."},
        {"role": "user", "content": [{"type": "text", "text": "Part one. "}, {"type": "text", "text": "Part two."}]},
    ],
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("builtin_tok")
    write_builtin_tokenizer_files(path)
    return path


@pytest.fixture(scope="module")
def ours(folder):
    return Tokenizer.from_folder(folder)


@pytest.fixture(scope="module")
def hf(folder):
    return AutoTokenizer.from_pretrained(folder)


def test_hf_sees_the_same_vocabulary_and_special_tokens(ours, hf):
    assert len(hf) == ours.vocab_size == 8192
    assert hf.eos_token_id == ours.eos_token_id
    assert hf.pad_token_id == ours.pad_token_id
    assert hf.bos_token_id is None and ours.bos_token_id is None


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match_transformers(ours, hf, text):
    ids = ours.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert ours.encode(text, add_special_tokens=True) == hf.encode(text, add_special_tokens=True)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=80))
def test_encode_matches_transformers_on_random_text(ours, hf, text):
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_builtin_chat_template_matches_transformers(ours, hf, name, with_tools, add_generation_prompt):
    messages = CONVERSATIONS[name]
    tools = TOOLS if with_tools else None
    expected = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                      tokenize=False)
    assert ours.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt) == expected
    expected_ids = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                          tokenize=True, return_dict=False)
    assert ours.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                    tokenize=True) == expected_ids


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_template_kwargs_reach_the_template(ours, hf, enable_thinking):
    messages = CONVERSATIONS["user_only"]
    ours_text = ours.apply_chat_template(messages, enable_thinking=enable_thinking)
    assert ours_text == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                               enable_thinking=enable_thinking)
    assert ("<think>\n\n</think>" in ours_text) == (not enable_thinking)


def test_builtin_template_renders_chatml_with_tool_calls(ours):
    text = ours.apply_chat_template(CONVERSATIONS["tool_calls"], tools=TOOLS, add_generation_prompt=False)
    assert text.startswith("<|im_start|>system\nUse tools when needed.\n\n# Tools")
    assert json.dumps(TOOLS[0], ensure_ascii=False) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京", "unit": "c"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n{\"temp\": 14}\n</tool_response>\n<tool_response>" in text
    assert text.endswith("<|im_start|>user\nThanks<|im_end|>\n")


LLAMA3_STYLE_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- set date_string = strftime_now('%d %b %Y') %}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content'] | trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system_message = '' %}\n"
    "{%- endif %}\n"
    "<|start_header_id|>system<|end_header_id|>\n\n"
    "Today Date: {{ date_string }}\n\n"
    "{%- if tools is not none %}\n"
    "You have these functions:\n"
    "{%- for t in tools %}\n{{ t | tojson(indent=4) }}\n\n{%- endfor %}\n"
    "{%- endif %}\n"
    "{{ system_message }}<|eot_id|>\n"
    "{%- for message in messages %}\n"
    "    {%- if message.role not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + message.role) }}{% endif %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim "
    "+ '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)


@pytest.fixture(scope="module")
def llama_style_folder(folder, tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_style_tok")
    shutil.copyfile(folder / "tokenizer.json", path / "tokenizer.json")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(chat_template=LLAMA3_STYLE_TEMPLATE, bos_token="<|endoftext|>", eos_token={"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False,
                  "normalized": False, "rstrip": False, "single_word": False, "special": True})
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_foreign_template_with_bos_date_and_indented_tojson_matches_transformers(
        llama_style_folder, with_tools, add_generation_prompt):
    ours = Tokenizer.from_folder(llama_style_folder)
    hf = AutoTokenizer.from_pretrained(llama_style_folder)
    messages = CONVERSATIONS["system_user_assistant"]
    tools = TOOLS if with_tools else None
    kwargs = dict(tools=tools, add_generation_prompt=add_generation_prompt)
    ours_text = ours.apply_chat_template(messages, **kwargs)
    assert ours_text == hf.apply_chat_template(messages, tokenize=False, **kwargs)
    assert ours_text.startswith("<|endoftext|><|start_header_id|>system")
    assert ours.apply_chat_template(messages, tokenize=True, **kwargs) == hf.apply_chat_template(
        messages, tokenize=True, return_dict=False, **kwargs)


def test_template_raise_exception_becomes_a_clear_error(llama_style_folder):
    ours = Tokenizer.from_folder(llama_style_folder)
    with pytest.raises(ChatTemplateError, match="bad role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_files_take_precedence_like_transformers(folder, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(folder / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}")
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text(
        "TOOLS:{{ tools | length }}{% for m in messages %}|{{ m.content }}{% endfor %}")
    ours, hf = Tokenizer.from_folder(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    messages = CONVERSATIONS["system_user_assistant"]
    for tools in (None, TOOLS):
        assert ours.apply_chat_template(messages, tools=tools) == hf.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(messages, tools=TOOLS).startswith("TOOLS:2|")
