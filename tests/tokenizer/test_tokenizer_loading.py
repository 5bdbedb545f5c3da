"""Loading tokenizers from folders: stop ids from every config file, template sources, clear errors."""
from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer, GenerationConfig

from prefixserve.tokenizer import (ChatTemplateError, Tokenizer, TokenizerFileMissingError, TokenizerLoadError,
                                   load_tokenizer, write_builtin_tokenizer_files)


@pytest.fixture()
def folder(tmp_path):
    write_builtin_tokenizer_files(tmp_path)
    return tmp_path


def test_written_folder_has_hf_layout(folder):
    assert {p.name for p in folder.iterdir()} == {"tokenizer.json", "tokenizer_config.json",
                                                  "special_tokens_map.json"}
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"]
    assert config["eos_token"] == "<|im_end|>" and config["pad_token"] == "<|endoftext|>"


def test_eos_ids_are_the_union_of_tokenizer_config_config_and_generation_config(folder):
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [8187, 8185, 17]}))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 42, "bos_token_id": 8185}))
    tok = load_tokenizer(str(folder))
    hf_eos = GenerationConfig.from_pretrained(folder).eos_token_id
    hf_tok = AutoTokenizer.from_pretrained(folder)
    assert tok.eos_token_ids == set(hf_eos) | {42, hf_tok.eos_token_id}
    assert tok.eos_token_id == hf_tok.eos_token_id


def test_eos_from_model_files_when_tokenizer_config_has_none(folder):
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["eos_token"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 8185}))
    tok = Tokenizer.from_folder(folder)
    assert tok.eos_token_id == 8185 and tok.eos_token_ids == {8185}


def test_bad_eos_value_names_the_file(folder):
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": "<|im_end|>"}))
    with pytest.raises(TokenizerLoadError, match="generation_config.json: eos_token_id"):
        Tokenizer.from_folder(folder)


def test_missing_tokenizer_json_is_a_clear_error(folder):
    (folder / "tokenizer.json").unlink()
    with pytest.raises(TokenizerFileMissingError, match="no tokenizer.json"):
        load_tokenizer(str(folder))


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerFileMissingError, match="neither"):
        load_tokenizer(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="non-empty"):
        load_tokenizer("")


def test_unknown_special_token_is_a_clear_error(folder):
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|not_there|>"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerLoadError, match="not_there"):
        Tokenizer.from_folder(folder)


def test_named_templates_and_legacy_chat_template_json_match_transformers(folder, tmp_path_factory):
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "D{% for m in messages %}{{ m.content }}{% endfor %}"},
                               {"name": "tool_use", "template": "T{{ tools | length }}"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ours, hf = Tokenizer.from_folder(folder), AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "x"}]
    for tools in (None, [{"name": "f"}]):
        assert ours.apply_chat_template(messages, tools=tools) == hf.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages, chat_template="tool_use", tools=[]) == "T0"

    legacy = tmp_path_factory.mktemp("legacy")
    shutil.copyfile(folder / "tokenizer.json", legacy / "tokenizer.json")
    (legacy / "chat_template.json").write_text(json.dumps({"chat_template": "L{{ messages[0].content }}"}))
    assert Tokenizer.from_folder(legacy).apply_chat_template(messages) == "Lx"


def test_no_template_and_empty_conversation_are_clear_errors(folder):
    (folder / "tokenizer_config.json").unlink()
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer.from_folder(folder).apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="empty"):
        Tokenizer.builtin().apply_chat_template([])


def test_template_sandbox_blocks_python_internals():
    tok = Tokenizer.builtin()
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"role": "user", "content": "x"}],
                                chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")


def test_special_token_variables_seen_by_templates_match_transformers(folder):
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(unk_token="<|endoftext|>", additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    template = ("{{ bos_token is defined }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}|"
                "{{ additional_special_tokens is defined }}|{{ documents }}|{{ tools }}")
    messages = [{"role": "user", "content": "x"}]
    assert Tokenizer.from_folder(folder).apply_chat_template(messages, chat_template=template) == \
        AutoTokenizer.from_pretrained(folder).apply_chat_template(messages, chat_template=template, tokenize=False)

