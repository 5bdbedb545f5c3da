"""MissExplainer: divergence against the closest remembered request or a named one."""
from __future__ import annotations

import random

import pytest

from prefixserve.diagnose import MissExplainer


def brute_lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_divergence_is_the_longest_common_prefix_with_remembered_requests():
    rng = random.Random(0)
    base = [rng.randrange(100) for _ in range(64)]
    explainer = MissExplainer()
    seen = []
    for i in range(40):
        seq = base[:rng.randrange(1, 64)] + [rng.randrange(100) for _ in range(rng.randrange(1, 20))]
        d = explainer.explain(f"r{i}", seq, num_cached_tokens=5)
        expected = max((brute_lcp(s, seq) for s in seen), default=0)
        assert d.cached_tokens == 5 and d.num_tokens == len(seq)
        if seen:
            assert d.shared_tokens == expected
            assert d.divergence_position == (expected if expected < len(seq) else None)
        else:
            assert d.compared_to is None and d.note
        seen.append(seq)


def test_parts_texts_and_json():
    explainer = MissExplainer(decode=lambda ids, skip_special_tokens=False: "".join(chr(97 + i) for i in ids))
    explainer.explain("a", [0, 1, 2, 3, 4, 5], spans=[("system", 0, 3), ("new user turn", 3, 6)])
    d = explainer.explain("b", [0, 1, 2, 3, 9, 9], spans=[("system", 0, 3), ("new user turn", 3, 6)])
    assert (d.compared_to, d.divergence_position, d.part) == ("a", 4, "new user turn")
    assert d.current_text == "jj" and d.earlier_text == "ef"
    payload = d.to_dict()
    assert set(payload) == {"cached_tokens", "prompt_tokens", "compared_to", "shared_tokens",
                            "divergence_position", "part", "current_text", "earlier_text", "note"}


def test_diagnose_against_a_named_request_and_salts():
    explainer = MissExplainer()
    explainer.explain("x", [1, 2, 3, 4])
    explainer.explain("y", [1, 2, 9, 9])
    d = explainer.explain("z", [1, 2, 3, 7], diagnose_against="y")
    assert (d.compared_to, d.divergence_position) == ("y", 2)
    assert explainer.explain("w", [1, 2, 3, 7]).compared_to == "z"      # closest: all 4 shared
    assert explainer.explain("s", [1, 2, 3, 4], cache_salt="other").compared_to is None
    # another salt's request and an unknown id get the same answer: ids of other salts are not confirmed
    other_salt = explainer.explain("t", [1], cache_salt="other", diagnose_against="x").note
    unknown = explainer.explain("u", [1], diagnose_against="nope").note
    assert other_salt.replace("'x'", "ID") == unknown.replace("'nope'", "ID")
    assert "not remembered" in unknown


def test_memory_is_bounded():
    explainer = MissExplainer(max_requests=2)
    for i in range(3):
        explainer.explain(f"r{i}", [i, i, i])
    assert "not remembered" in explainer.explain("q", [0, 0, 0], diagnose_against="r0").note
    with pytest.raises(ValueError, match="empty"):
        explainer.explain("e", [])
