"""Token-exact breakpoints (kv/partial_blocks.py) against a brute-force model of the worker.

The model plays the worker: every slot of every physical block holds the context its K/V was
computed from (all tokens up to and including that position); block copies copy those contexts.
A hit is right when every slot it hands over holds exactly the request's own context, and a
copy-on-write is right when no request's computed slots ever change under it.
"""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixserve.kv import KVCacheConfig, KVCacheManager


class Worker:
    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}
        self.live: dict[str, list[int]] = {}    # rid -> tokens, while it holds blocks
        self.computed: dict[str, int] = {}

    def step(self, rid: str, tokens: list[int], breakpoints=(), write_limit=None,
             budget: int = 10_000) -> int:
        """One scheduler step for rid (admitting it first); returns the hit of an admission."""
        kv, bs = self.kv, self.kv.block_size
        hit_tokens = None
        if rid not in self.computed:
            hit = kv.find_cached_prefix(rid, tokens, breakpoints=breakpoints)
            start, hit_tokens = hit.num_tokens, hit.num_tokens
        else:
            hit, start = None, self.computed[rid]
        num_new = min(len(tokens) - start, budget)
        # as the scheduler cuts a chunk at the next breakpoint inside a block
        for t in sorted(breakpoints):
            if t > start and t % bs:
                num_new = min(num_new, t - start)
                break
        alloc = kv.allocate_slots(rid, tokens, start, num_new, hit=hit,
                                  breakpoints=breakpoints, write_limit=write_limit)
        assert alloc is not None
        for src, dst in alloc.copies:
            for off in range(bs):
                if (src, off) in self.slots:
                    self.slots[(dst, off)] = self.slots[(src, off)]
        self.live[rid] = tokens
        if hit_tokens is not None:
            self.check(rid, hit_tokens)   # the hit's slots, after its copies, before any write
        table = kv.block_table(rid)
        for pos in range(start, start + num_new):
            self.slots[(table[pos // bs], pos % bs)] = tuple(tokens[:pos + 1])
        self.computed[rid] = start + num_new
        self.check_all()
        return hit_tokens if hit_tokens is not None else -1

    def run(self, rid, tokens, breakpoints=(), write_limit=None, budget=10_000, free=True) -> int:
        hit = self.step(rid, tokens, breakpoints, write_limit, budget)
        while self.computed[rid] < len(tokens):
            self.step(rid, tokens, breakpoints, write_limit, budget)
        if free:
            self.free(rid)
        return hit

    def free(self, rid: str) -> None:
        self.kv.free(rid)
        del self.live[rid], self.computed[rid]
        self.kv.check_integrity()

    def check(self, rid: str, upto: int) -> None:
        bs, table, tokens = self.kv.block_size, self.kv.block_table(rid), self.live[rid]
        for pos in range(upto):
            assert self.slots.get((table[pos // bs], pos % bs)) == tuple(tokens[:pos + 1]), \
                f"{rid}: slot of position {pos} holds another context"

    def check_all(self) -> None:
        for rid in self.live:
            self.check(rid, self.computed.get(rid, 0))
        self.kv.check_integrity()


def manager(block_size: int, num_blocks: int = 64) -> KVCacheManager:
    return KVCacheManager(KVCacheConfig(num_blocks=num_blocks, block_size=block_size))


@settings(max_examples=60, deadline=None)
@given(bs=st.sampled_from([2, 4, 16]), n=st.integers(3, 60), data=st.data())
def test_a_hit_at_a_breakpoint_reuses_exactly_that_many_tokens(bs, n, data):
    rng = random.Random(data.draw(st.integers(0, 10**6)))
    prompt = [rng.randrange(100) for _ in range(n)]
    t = data.draw(st.integers(1, n - 1))
    w = Worker(manager(bs))
    w.run("a", prompt, breakpoints=(t,), budget=data.draw(st.sampled_from([3, 7, 10_000])))
    tail = [rng.randrange(100, 200) for _ in range(data.draw(st.integers(1, 9)))]
    # the oracle: the breakpoint's prefix is cached, whatever its offset in its block
    assert w.run("b", prompt[:t] + tail, breakpoints=(t,)) == t
    # without the breakpoint only the full blocks before it are found
    assert w.run("c", prompt[:t] + [300, 301]) == t // bs * bs


@settings(max_examples=40, deadline=None)
@given(bs=st.sampled_from([2, 4, 16]), n=st.integers(3, 40), data=st.data())
def test_writes_after_a_shared_partial_block_copy_it(bs, n, data):
    """Three requests hold the breakpoint's block at once and write different tokens after it:
    each keeps its own context (the model checks every computed slot after every step)."""
    rng = random.Random(data.draw(st.integers(0, 10**6)))
    prompt = [rng.randrange(100) for _ in range(n)]
    t = data.draw(st.integers(1, n - 1))
    w = Worker(manager(bs))
    w.run("owner", prompt, breakpoints=(t,), free=False)
    hits = [w.step(f"r{i}", prompt[:t] + [200 + i] * (i + 1), breakpoints=(t,)) for i in range(2)]
    # the owner still holds its copy of the block; the partial one is cached beside it
    assert hits == [t, t]
    for i in range(2):
        w.step(f"r{i}", prompt[:t] + [200 + i] * (i + 1) + [300 + i], breakpoints=(t,))
    w.check_all()
    for rid in list(w.live):
        w.free(rid)
    assert w.kv.stats().num_used_blocks == 0


def test_several_breakpoints_in_one_block_and_across_blocks():
    w = Worker(manager(4))
    prompt = list(range(1, 30))
    marks = (5, 6, 11, 16, 21)
    w.run("a", prompt, breakpoints=marks)
    for t in marks:
        assert w.run(f"b{t}", prompt[:t] + [99, 98], breakpoints=(t,)) == t


def test_the_partial_block_is_evictable_like_any_cached_block():
    w = Worker(manager(4, num_blocks=8))
    prompt = list(range(1, 12))
    w.run("a", prompt, breakpoints=(7,))
    assert w.kv.stats().num_cached_blocks == 3   # blocks 0, 1 (full) and 7's partial block
    w.run("flood", list(range(500, 531)))        # needs all 8 blocks: every cached block goes
    assert w.kv.stats().num_cached_blocks == 7
    assert w.run("b", prompt[:7] + [99], breakpoints=(7,)) == 0


def test_an_exact_pin_holds_the_partial_block():
    kv = manager(4, num_blocks=8)
    w = Worker(kv)
    prompt = list(range(1, 12))
    w.run("a", prompt, breakpoints=(7,))
    info = kv.pin_prefix(prompt, num_tokens=7, exact=True)
    assert info.num_tokens == 7 and len(info.block_ids) == 2
    assert kv.pin_prefix(prompt, num_tokens=7).num_tokens == 4   # cache_control: full blocks
    w.run("flood", list(range(500, 521)))        # all 6 blocks but the 2 pinned ones
    kv.check_integrity()
    assert w.run("b", prompt[:7] + [99], breakpoints=(7,)) == 7


def test_a_write_limit_caches_only_the_marked_prefix():
    w = Worker(manager(4))
    prompt = list(range(1, 30))
    w.run("a", prompt, breakpoints=(10,), write_limit=10)
    # blocks 0, 1 and the partial block of 10; nothing of the 19 tokens after the mark
    assert w.kv.stats().num_cached_blocks == 3
    assert w.run("b", prompt + [6], breakpoints=(10,), write_limit=10) == 10
    assert w.run("c", prompt + [5], write_limit=0) == 8


def test_a_breakpoint_at_the_prompt_end_is_cached_when_the_request_ends():
    """Registered at free: the request ended right after the step that computed it."""
    w = Worker(manager(4))
    prompt = list(range(1, 8))
    w.run("a", prompt, breakpoints=(7,))
    assert w.run("b", prompt + [50, 51], breakpoints=(7,)) == 7


@pytest.mark.parametrize("salt_b", ["other", None])
def test_a_partial_block_never_crosses_salts(salt_b):
    kv = manager(4)
    prompt = list(range(1, 12))
    hit = kv.find_cached_prefix("a", prompt, cache_salt="t1", breakpoints=(7,))
    kv.allocate_slots("a", prompt, 0, 7, hit=hit, cache_salt="t1", breakpoints=(7,))
    kv.allocate_slots("a", prompt, 7, 4)
    kv.free("a")
    other = prompt[:7] + [99, 98]
    assert kv.find_cached_prefix("b", other, cache_salt="t1", breakpoints=(7,)).num_tokens == 7
    assert kv.find_cached_prefix("b", other, cache_salt=salt_b, breakpoints=(7,)).num_tokens == 0
