"""The miss explainer's memory is shared out per tenant: a flood of one tenant's requests
pushes out its own oldest, never the history of a tenant that holds fewer."""
from __future__ import annotations

from prefixserve.diagnose import ClosestPrefixIndex
from prefixserve.diagnose.live import MissExplainer


def test_a_flooding_tenant_forgets_its_own_requests_first():
    explainer = MissExplainer(max_requests=10)
    for i in range(3):
        explainer.remember(f"quiet-{i}", [1, 2, 3, i], cache_salt="q", tenant="quiet")
    for i in range(50):
        explainer.remember(f"flood-{i}", [9, 9, i, i], cache_salt="f", tenant="flood")
    d = explainer.explain("quiet-new", [1, 2, 3, 2, 7], cache_salt="q", tenant="quiet", remember=False)
    assert d.compared_to == "quiet-2" and d.shared_tokens == 4
    # flood keeps only its newest 7 (10 less quiet's 3)
    for i, kept in ((42, False), (43, True), (49, True)):
        d = explainer.explain("flood-new", [9, 9, 0, 0], cache_salt="f", tenant="flood", remember=False,
                              diagnose_against=f"flood-{i}")
        assert (d.compared_to == f"flood-{i}") == kept


def test_the_tenant_holding_most_gives_up_its_least_recently_used():
    index = ClosestPrefixIndex(max_entries=4)
    index.add("a0", [1] * 20, owner="a")
    index.add("a1", [2] * 20, owner="a")
    index.add("a2", [3] * 20, owner="a")
    assert index.closest([1] * 20)[0] == "a0"   # a0 is now a's most recently matched
    index.add("b0", [4] * 20, owner="b")
    index.add("b1", [5] * 20, owner="b")          # a holds most: a1, its least recently used, goes
    assert [r for r in ("a0", "a1", "a2", "b0", "b1") if r in index] == ["a0", "a2", "b0", "b1"]
    index.add("b2", [6] * 20, owner="b")          # now b holds most: b0 goes
    assert [r for r in ("a0", "a2", "b0", "b1", "b2") if r in index] == ["a0", "a2", "b1", "b2"]


def test_one_tenant_is_plain_least_recently_used():
    index = ClosestPrefixIndex(max_entries=3)
    for i in range(5):
        index.add(f"r{i}", [i] * 20)
    assert [r for r in ("r0", "r1", "r2", "r3", "r4") if r in index] == ["r2", "r3", "r4"]
