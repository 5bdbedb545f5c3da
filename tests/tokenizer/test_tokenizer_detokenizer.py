"""IncrementalDetokenizer: deltas add up to decode(generated ids) and never split a character."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixserve.tokenizer import IncrementalDetokenizer, Tokenizer


def _byte_to_char() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


BYTE_TO_CHAR = _byte_to_char()


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.builtin()


def byte_ids(tok: Tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte, so every multi-byte character is split across tokens."""
    return [tok.token_to_id(BYTE_TO_CHAR[b]) for b in text.encode("utf-8")]


def stream(tok, ids, prompt_ids=(), skip_special_tokens=True):
    detok = IncrementalDetokenizer(tok, list(prompt_ids), skip_special_tokens=skip_special_tokens)
    deltas = [detok.add(i) for i in ids]
    return detok, deltas


def test_byte_tokens_cover_all_256_bytes(tok):
    assert None not in byte_ids(tok, "".join(chr(c) for c in range(256)))


@pytest.mark.parametrize("text", ["😀", "你好，世界", "naïve 👨‍👩‍👧 done", "a🇯🇵b", "Привет"])
def test_split_characters_are_emitted_whole(tok, text):
    ids = byte_ids(tok, text)
    detok, deltas = stream(tok, ids)
    assert "".join(deltas) == text == detok.text
    assert all("\ufffd" not in d for d in deltas)
    emitted = ""
    for d in deltas:
        emitted += d
        assert text.startswith(emitted)
    assert detok.finish() == ""


def test_emoji_bytes_wait_until_complete(tok):
    ids = byte_ids(tok, "😀")
    _, deltas = stream(tok, ids)
    assert deltas == ["", "", "", "😀"]


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=60).filter(lambda s: "\ufffd" not in s))
def test_deltas_of_encoded_text_rebuild_it_without_partial_characters(tok, text):
    ids = tok.encode(text)
    detok, deltas = stream(tok, ids, skip_special_tokens=False)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert detok.finish() == ""


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=8192 + 300), max_size=40),
       st.lists(st.integers(min_value=0, max_value=8191), max_size=8),
       st.booleans())
def test_arbitrary_ids_stream_to_exactly_decode(tok, ids, prompt_ids, skip):
    detok, deltas = stream(tok, ids, prompt_ids, skip_special_tokens=skip)
    tail = detok.finish()
    assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=skip) == detok.text


def test_ids_beyond_the_vocabulary_emit_nothing(tok):
    ids = tok.encode("fine")
    detok, deltas = stream(tok, [ids[0], 8192, 10_000, *ids[1:]])
    assert deltas[1:3] == ["", ""]
    assert detok.text == "fine"
    assert detok.token_ids == ids


def test_prompt_context_and_special_tokens(tok):
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True)
    generated = tok.encode(" Hello there!") + [tok.token_to_id("<|im_end|>")]
    detok, deltas = stream(tok, generated, prompt)
    assert "".join(deltas) == " Hello there!" == tok.decode(generated)
    detok, deltas = stream(tok, generated, prompt, skip_special_tokens=False)
    assert "".join(deltas) == " Hello there!<|im_end|>"


def test_prompt_ending_inside_a_character_does_not_leak_into_the_output(tok):
    ids = byte_ids(tok, "€")  # three bytes
    detok, deltas = stream(tok, ids[2:] + tok.encode("ok"), prompt_ids=ids[:2])
    assert "".join(deltas) + detok.finish() == tok.decode(ids[2:] + tok.encode("ok"))
    assert detok.text.endswith("ok")


def test_unfinished_character_is_flushed_by_finish(tok):
    ids = byte_ids(tok, "😀")[:2]
    detok, deltas = stream(tok, ids)
    assert deltas == ["", ""]
    assert detok.finish() == tok.decode(ids) == "\ufffd"
