"""The shipped tokenizer: size, special tokens, exact byte-level round trip, out-of-vocab ids,
and a deterministic training script."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixserve.tokenizer import BUILTIN_VOCAB_SIZE, Tokenizer, load_tokenizer

REPO = Path(__file__).resolve().parents[2]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_NOT_SPECIAL = ["<tool_call>", "</tool_call>", "<think>", "</think>"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.builtin()


def test_vocabulary_is_exactly_8192_ids_with_the_chatml_tokens_at_the_end(tok):
    vocab = tok.backend.get_vocab(with_added_tokens=True)
    assert tok.vocab_size == len(vocab) == BUILTIN_VOCAB_SIZE == 8192
    assert sorted(vocab.values()) == list(range(8192))
    added = {tok.token_to_id(t) for t in SPECIAL + ADDED_NOT_SPECIAL}
    assert added == set(range(8192 - 7, 8192))
    assert tok.special_token_ids == {tok.token_to_id(t) for t in SPECIAL}


def test_eos_and_pad_ids(tok):
    assert tok.eos_token_id == tok.token_to_id("<|im_end|>")
    assert tok.eos_token_ids == {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")}
    assert tok.pad_token_id == tok.token_to_id("<|endoftext|>")
    assert tok.bos_token_id is None


def test_special_tokens_in_text_are_single_ids_and_skipped_on_decode(tok):
    text = "<|im_start|>user\nhi<|im_end|><think>x</think><tool_call>{}</tool_call><|endoftext|>"
    ids = tok.encode(text)
    for token in SPECIAL + ADDED_NOT_SPECIAL:
        assert tok.token_to_id(token) in ids
    assert tok.decode(ids, skip_special_tokens=False) == text
    # Tool-call and think markers are not special (as in Qwen3): they survive so they can be parsed.
    assert tok.decode(ids) == "user\nhi<think>x</think><tool_call>{}</tool_call>"


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_any_text_round_trips_exactly(tok, text):
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF), max_size=30)
       | st.text(alphabet=st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF), max_size=30))
def test_emoji_and_cjk_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_common_english_is_compressed(tok):
    text = "The weather this week will be changeable, with rain on Monday and sun on Wednesday."
    assert len(tok.encode(text)) < len(text.encode()) / 3


def test_ids_beyond_the_vocabulary_are_dropped_not_garbled(tok):
    ids = tok.encode("hello world")
    noisy = [8192, *ids[:1], 9000, 151935, *ids[1:], 8192 + 5]
    assert tok.decode(noisy) == "hello world"
    assert tok.known_ids(noisy) == ids
    with pytest.raises(ValueError, match="negative"):
        tok.decode([-1])


def test_encode_rejects_non_strings(tok):
    with pytest.raises(TypeError, match="str"):
        tok.encode(b"bytes")  # type: ignore[arg-type]


def test_random_models_use_the_builtin_tokenizer():
    assert load_tokenizer("random:qwen3-tiny").encode("a test") == Tokenizer.builtin().encode("a test")


def _train_module():
    spec = importlib.util.spec_from_file_location("train_tokenizer", REPO / "scripts" / "train_tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_training_is_deterministic_and_has_the_shipped_shape():
    train = _train_module()
    files = train.training_files()
    first, second = train.train(files).to_str(), train.train(files).to_str()
    assert first == second
    trained = json.loads(first)
    shipped = json.loads((REPO / "prefixserve/tokenizer/data/tokenizer.json").read_text())
    assert trained["pre_tokenizer"] == shipped["pre_tokenizer"]
    assert trained["added_tokens"] == shipped["added_tokens"]
    assert len(trained["model"]["vocab"]) == len(shipped["model"]["vocab"]) == 8192 - 7


def test_training_manifest_lists_the_corpus_files_shipped_with_the_script():
    manifest = json.loads((REPO / "prefixserve/tokenizer/data/training_manifest.json").read_text())
    listed = {entry["path"] for entry in manifest["files"]}
    corpus = {p.relative_to(REPO).as_posix() for p in (REPO / "scripts/tokenizer_corpus").glob("*.txt")}
    assert corpus <= listed
