"""Benchmark workloads: deterministic, well formed, and their ideal token counts match a brute-force oracle."""
from __future__ import annotations

import pytest

from prefixserve.benchmarks.figures import percentile
from prefixserve.benchmarks.workloads import (TOKEN_HIGH, TOKEN_LOW, WORKLOAD_NAMES, BenchRequest, Workload,
                                              build_workload, without_salts)

ALL = [(name, quick) for name in WORKLOAD_NAMES for quick in (True, False)]


def _lcp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _brute_force_ideal(w: Workload) -> int:
    total, seen = 0, []
    for r in w.requests:
        common = max((_lcp(r.prompt_token_ids, p.prompt_token_ids) for p in seen if p.cache_salt == r.cache_salt),
                     default=0)
        total += max(len(r.prompt_token_ids) - common, 1)
        seen.append(r)
    return total


@pytest.mark.parametrize("name,quick", ALL)
def test_workloads_are_deterministic_and_well_formed(name: str, quick: bool) -> None:
    w = build_workload(name, quick)
    assert w == build_workload(name, quick)
    assert w.name == name
    assert len({r.request_id for r in w.requests}) == len(w.requests)
    for r in w.requests:
        assert all(TOKEN_LOW <= t < TOKEN_HIGH for t in r.prompt_token_ids)
        if r.shared_prefix_len:
            # The prefix a careful user would cache really is shared with another request (or a later turn).
            prefix = r.prompt_token_ids[:r.shared_prefix_len]
            assert any(o is not r and o.prompt_token_ids[:len(prefix)] == prefix for o in w.requests)
    assert w.ideal_computed_tokens() == _brute_force_ideal(w)


def test_quick_workloads_are_smaller() -> None:
    for name in WORKLOAD_NAMES:
        assert build_workload(name, True).prompt_tokens < build_workload(name, False).prompt_tokens


def test_long_doc_qa_is_the_target_shape() -> None:
    w = build_workload("long-doc-qa")
    assert len(w.requests) == 16 and all(r.max_tokens == 16 for r in w.requests)
    doc = w.requests[0].prompt_token_ids[:1024]
    assert all(r.prompt_token_ids[:1024] == doc for r in w.requests)
    assert all(24 <= len(r.prompt_token_ids) - 1024 <= 40 for r in w.requests)
    # The document shares no further token with any question by accident, so the ideal is exact.
    assert w.ideal_computed_tokens() == 1024 + sum(len(r.prompt_token_ids) - 1024 for r in w.requests)


def test_long_doc_orders_hold_the_same_prompts_in_different_orders() -> None:
    orders = {o: build_workload(f"long-doc-qa-{o}") for o in ("random", "tile", "interleave")}
    prompts = {o: sorted(r.prompt_token_ids for r in w.requests) for o, w in orders.items()}
    assert prompts["random"] == prompts["tile"] == prompts["interleave"]
    docs = {o: [r.prompt_token_ids[:32] for r in w.requests] for o, w in orders.items()}
    assert all(a != b for a, b in zip(docs["tile"], docs["tile"][1:]))  # tile never repeats a document
    runs = sum(1 for a, b in zip(docs["interleave"], docs["interleave"][1:]) if a != b)
    assert runs == len(set(docs["interleave"])) - 1  # interleave keeps each document's requests together
    assert docs["random"] not in (docs["tile"], docs["interleave"])
    assert all(w.kv_blocks for w in orders.values())


def test_multi_turn_history_grows_turn_by_turn() -> None:
    w = build_workload("multi-turn")
    assert len(w.rounds) > 1
    for prev, cur in zip(w.rounds, w.rounds[1:]):
        for a, b in zip(prev, cur):
            assert b.prompt_token_ids[:len(a.prompt_token_ids)] == a.prompt_token_ids
            assert len(b.prompt_token_ids) > len(a.prompt_token_ids)


def test_no_sharing_prompts_share_nothing() -> None:
    w = build_workload("no-sharing")
    assert len({r.prompt_token_ids[0] for r in w.requests}) == len(w.requests)
    assert w.ideal_computed_tokens() == w.prompt_tokens


def test_tenants_differ_from_unsalted_exactly_by_the_forbidden_sharing() -> None:
    w = build_workload("tenants")
    plain = without_salts(w)
    assert [r.prompt_token_ids for r in plain.requests] == [r.prompt_token_ids for r in w.requests]
    assert all(r.cache_salt is None for r in plain.requests)
    extra = (w.notes["tenants"] - 1) * w.notes["shared_prefix_len"]
    assert w.ideal_computed_tokens() - plain.ideal_computed_tokens() == extra


def test_bad_requests_and_names_are_rejected() -> None:
    with pytest.raises(ValueError, match="prompt_token_ids is empty"):
        BenchRequest("a", (), 4)
    with pytest.raises(ValueError, match="shared_prefix_len"):
        BenchRequest("a", (1, 2), 4, shared_prefix_len=2)
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        build_workload("nope")
    r = BenchRequest("a", (1, 2), 4)
    with pytest.raises(ValueError, match="not unique"):
        Workload("w", "", 0, ((r, r),))


@pytest.mark.parametrize("q", [0, 10, 50, 90, 100])
def test_percentile_matches_numpy(q: float) -> None:
    import numpy as np
    values = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6, 5.0]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
