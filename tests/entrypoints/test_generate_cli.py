"""`prefixserve generate`: prompts are the texts given, and come from a file only with --input.

Oracle: the model's tokenizer, which says how many prompt tokens each text is."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from prefixserve.entrypoints.cli import main
from prefixserve.entrypoints.generate import read_prompts
from prefixserve.tokenizer.loader import load_tokenizer

MODEL = "random:qwen3-tiny"
FILE_PROMPTS = ["first prompt", "a second, longer prompt with a\ttab"]


@pytest.fixture
def jsonl(tmp_path: Path) -> Path:
    path = tmp_path / "one.jsonl"
    path.write_text(f'"{FILE_PROMPTS[0]}"\n\n{{"prompt": "{FILE_PROMPTS[1]}"}}\n'.replace("\t", "\\t"))
    return path


def prompt_lengths(capsys, *argv: str) -> list[int]:
    assert main(["generate", *argv, "--max-tokens", "1", "--num-kv-blocks", "32"]) == 0
    return [int(n) for n in re.findall(r"^--- \S+: (\d+) prompt tokens", capsys.readouterr().out, re.M)]


def test_a_file_name_given_as_a_prompt_stays_literal_text_and_says_so(capsys, caplog, jsonl, monkeypatch):
    monkeypatch.chdir(jsonl.parent)
    tokenizer = load_tokenizer(MODEL)
    assert prompt_lengths(capsys, "one.jsonl") == [len(tokenizer.encode("one.jsonl"))]
    assert [r.getMessage() for r in caplog.records if "--input" in r.getMessage()] == [
        "the prompt 'one.jsonl' is taken as text, though a file has that name; --input one.jsonl reads prompts from it"]
    caplog.clear()
    prompt_lengths(capsys, "two.jsonl")   # no such file: plain text, nothing to say
    assert not [r for r in caplog.records if "--input" in r.getMessage()]


def test_input_reads_the_prompts_of_a_file_after_the_literal_ones(capsys, jsonl):
    tokenizer = load_tokenizer(MODEL)
    expected = [len(tokenizer.encode(text)) for text in ["hello", *FILE_PROMPTS]]
    assert prompt_lengths(capsys, "hello", "--input", str(jsonl)) == expected


def test_input_file_formats(tmp_path):
    plain = tmp_path / "prompts.txt"
    plain.write_text('one per line\n\n{"prompt": "is text here"}\n')
    assert read_prompts(plain) == ["one per line", '{"prompt": "is text here"}']
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('"a"\n{"prompt": "b", "id": 3}\n')
    assert read_prompts(jsonl) == ["a", "b"]


@pytest.mark.parametrize("line, mention", [("not json", "p.jsonl:2: not JSON"),
                                            ('{"text": "x"}', 'p.jsonl:2: expected'),
                                            ("[1, 2]", "p.jsonl:2: expected")])
def test_a_bad_jsonl_line_names_the_file_and_line(tmp_path, line, mention):
    path = tmp_path / "p.jsonl"
    path.write_text(f'"fine"\n{line}\n')
    with pytest.raises(ValueError, match=re.escape(mention)):
        read_prompts(path)


def test_no_prompt_at_all_is_an_error(capsys):
    assert main(["generate"]) == 2
    assert "--input" in capsys.readouterr().err
