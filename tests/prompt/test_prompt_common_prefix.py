"""common_prefix_len against a naive loop, on strings and token sequences."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from prefixserve.prompt import common_prefix_len


def naive(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# Few symbols and a shared head make long common prefixes likely.
texts = st.tuples(st.text("ab\n😀", max_size=40), st.text("ab\n😀", max_size=20), st.text("ab\n😀", max_size=20))
tokens = st.tuples(*[st.lists(st.integers(0, 3), max_size=40)] * 3)


@given(texts)
def test_strings(parts):
    head, x, y = parts
    assert common_prefix_len(head + x, head + y) == naive(head + x, head + y)


@given(tokens)
def test_token_lists(parts):
    head, x, y = parts
    assert common_prefix_len(head + x, head + y) == naive(head + x, head + y)


@given(tokens)
def test_mixed_sequence_types(parts):
    head, x, y = parts
    assert common_prefix_len(head + x, tuple(head + y)) == naive(head + x, head + y)


def test_any_sequences():
    assert common_prefix_len(range(5), [0, 1, 2, 9]) == 3
