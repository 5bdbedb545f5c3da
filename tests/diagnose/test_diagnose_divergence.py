"""Divergence positions against a brute-force longest common prefix over token ids."""
from __future__ import annotations

import random

import pytest

from prefixserve.diagnose import lint, load_renderer, read_log
from prefixserve.diagnose.divergence import ClosestPrefixIndex
from prefixserve.prompt import common_prefix_len
from diagnose_logs import RULE_LOGS, RULE_MODELS, clean_log, write_log


def brute_lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_common_prefix_len_matches_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        a = [rng.randrange(3) for _ in range(rng.randrange(0, 60))]
        b = a[:rng.randrange(0, len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(0, 5))]
        assert common_prefix_len(a, b) == brute_lcp(a, b)


def test_closest_matches_brute_force_per_salt():
    rng = random.Random(1)
    bases = [[rng.randrange(50) for _ in range(80)] for _ in range(4)]
    index = ClosestPrefixIndex()
    seen: list[tuple[str, list[int], str]] = []
    for i in range(150):
        base = rng.choice(bases)
        seq = base[:rng.randrange(0, 80)] + [rng.randrange(50) for _ in range(rng.randrange(1, 40))]
        salt = rng.choice(["a", "b"])
        rid, lcp = index.closest(seq, salt)
        same_salt = [(r, s) for r, s, t in seen if t == salt]
        expected = max((brute_lcp(s, seq) for _, s in same_salt), default=0)
        assert lcp == expected
        if same_salt:
            assert rid is not None and brute_lcp(dict(same_salt)[rid], seq) == expected
        else:
            assert rid is None
        index.add(f"r{i}", seq, salt)
        seen.append((f"r{i}", seq, salt))


def test_bounded_index_forgets_the_oldest():
    index = ClosestPrefixIndex(max_entries=2)
    for i in range(3):
        index.add(f"r{i}", [i] * 20)
    assert len(index) == 2 and "r0" not in index
    assert index.closest([0] * 20)[1] == 0   # r0 is gone: nothing shares its tokens
    assert index.closest([1] * 20) == ("r1", 20)
    with pytest.raises(ValueError, match="max_entries"):
        ClosestPrefixIndex(max_entries=0)


# Text logs, whose oracle is the template's token ids; a log with pictures is held to a server's
# cached tokens in test_diagnose_log_images_server.py.
@pytest.mark.parametrize("log", [clean_log, *(log for rule, log in RULE_LOGS.items() if rule not in RULE_MODELS)])
def test_lint_divergence_positions_are_the_longest_common_prefix(tmp_path, log):
    renderer = load_renderer("random:qwen3-tiny")
    records = read_log(write_log(tmp_path / "log.jsonl", log()))
    report = lint(records, renderer)
    tokenizer = renderer.tokenizer
    ids = {r.request_id: tokenizer.apply_chat_template(r.messages, tools=r.tools, tokenize=True)
           for r in records}
    order = [r.request_id for r in records]
    for pos, req in enumerate(report.requests):
        earlier = [ids[o] for o in order[:pos]]
        assert req.tokens == len(ids[req.request_id])
        if not earlier:
            assert req.divergence is None
            continue
        expected = max(brute_lcp(e, ids[req.request_id]) for e in earlier)
        assert req.divergence.position == expected
        assert brute_lcp(ids[req.divergence.compared_to], ids[req.request_id]) == expected
        # unbounded cache: the block-aligned shared prefix, never the last token
        assert req.reusable_tokens == min(expected, req.tokens - 1) // 16 * 16
