"""Eviction policies: LRU (tail first), LFU, priority, lazy deletion."""
import itertools

import pytest

from prefixserve.kv import (KVCacheConfig, KVCacheManager, LFUPolicy, LRUPolicy, PriorityPolicy,
                            make_policy)
from prefixserve.kv.block import Block


def make(policy, num_blocks=8, block_size=4):
    return KVCacheManager(KVCacheConfig(num_blocks=num_blocks, block_size=block_size,
                                        eviction_policy=policy))


def run(kv, rid, tokens, priority=0):
    hit = kv.find_cached_prefix(rid, tokens)
    alloc = kv.allocate_slots(rid, tokens, hit.num_tokens, len(tokens) - hit.num_tokens,
                              hit=hit, priority=priority)
    assert alloc is not None
    kv.check_integrity()
    return hit


def test_lru_pops_oldest_and_removes_from_the_middle():
    q = LRUPolicy()
    for i in range(5):
        q.push(Block(i))
    q.remove(2)
    assert len(q) == 4 and 2 not in q
    assert [q.pop() for _ in range(4)] == [0, 1, 3, 4]


@pytest.mark.parametrize("policy,field", [(LFUPolicy, "uses"), (PriorityPolicy, "priority")])
def test_heap_policies_order_by_key_then_age_with_lazy_deletion(policy, field):
    q = policy()
    keys = [3, 1, 2, 1, 3, 0]
    bs = [Block(i) for i in range(6)]
    for b, k in zip(bs, keys):
        setattr(b, field, k)
        q.push(b)
    q.remove(5)
    # Re-pushing a removed block makes it the newest of its key.
    q.remove(1)
    q.push(bs[1])
    assert q.order() == [3, 1, 2, 0, 4]
    assert [q.pop() for _ in range(5)] == [3, 1, 2, 0, 4]
    assert len(q) == 0


def test_heap_compaction_keeps_the_queue_exact():
    q = LFUPolicy()
    bs = [Block(i) for i in range(10)]
    for round_ in range(200):
        for b in bs:
            if b.block_id in q:
                q.remove(b.block_id)
            b.uses = (b.block_id * 7 + round_) % 5
            q.push(b)
    assert len(q._heap) <= 2 * len(q) + 65
    expected = sorted(range(10), key=lambda i: ((i * 7 + 199) % 5, i))
    assert [q.pop() for _ in range(10)] == expected


def test_make_policy_rejects_unknown():
    with pytest.raises(ValueError, match="eviction_policy"):
        make_policy("fifo")


def test_lru_evicts_a_chains_tail_before_its_head():
    kv = make("lru", num_blocks=4)
    prompt = list(range(13))          # 3 full blocks + 1 partial
    run(kv, "a", prompt)
    table = kv.block_table("a")
    kv.free("a")
    assert kv.eviction_order() == [table[2], table[1], table[0]]
    # One uncached block left; two more blocks needed: the tail goes first.
    kv.allocate_slots("b", list(range(100, 112)), 0, 12)
    assert kv.stats().evictions == 2
    assert kv.find_cached_prefix("c", prompt).num_tokens == 4


def test_lru_touch_makes_a_block_recent_again():
    kv = make("lru", num_blocks=6)
    run(kv, "a", list(range(5)))        # block A cached
    run(kv, "b", list(range(50, 55)))   # block B cached
    kv.free("a")
    kv.free("b")
    run(kv, "c", list(range(5)))        # hit A: taken back into use, then freed again
    kv.free("c")
    # 6 blocks: 2 hashed (A, B) + 4 free. Taking 5 evicts exactly one: B, the older.
    kv.allocate_slots("d", list(range(200, 220)), 0, 20)
    assert kv.find_cached_prefix("e", list(range(5))).num_tokens == 4
    assert kv.find_cached_prefix("e", list(range(50, 55))).num_tokens == 0


def test_lfu_keeps_frequently_used_blocks():
    kv = make("lfu", num_blocks=6)
    hot, cold = list(range(5)), list(range(50, 55))
    run(kv, "h0", hot)
    kv.free("h0")
    for i in range(3):
        run(kv, f"h{i + 1}", hot)
        kv.free(f"h{i + 1}")
    run(kv, "c", cold)                  # freed last: LRU would evict the hot block first
    kv.free("c")
    kv.allocate_slots("d", list(range(200, 220)), 0, 20)
    assert kv.find_cached_prefix("e", hot).num_tokens == 4
    assert kv.find_cached_prefix("e", cold).num_tokens == 0


def test_priority_keeps_blocks_of_important_requests_ties_by_lru():
    kv = make("priority", num_blocks=8)
    vip, low1, low2 = list(range(5)), list(range(50, 55)), list(range(80, 85))
    run(kv, "vip", vip, priority=5)
    run(kv, "l1", low1, priority=0)
    run(kv, "l2", low2, priority=0)
    kv.free("l1")
    kv.free("vip")        # freed between the low ones: LRU would evict it second
    kv.free("l2")
    # 3 hashed + 5 free; taking 7 evicts two: l1 (oldest low), then l2.
    kv.allocate_slots("d", list(range(200, 228)), 0, 28)
    assert kv.stats().evictions == 2
    assert kv.find_cached_prefix("e", vip).num_tokens == 4
    assert kv.find_cached_prefix("e", low1).num_tokens == 0
    assert kv.find_cached_prefix("e", low2).num_tokens == 0


def test_a_shared_block_keeps_its_highest_users_priority():
    kv = make("priority", num_blocks=6)
    prompt = list(range(5))
    run(kv, "vip", prompt, priority=9)
    run(kv, "low", prompt, priority=0)       # hits the vip's block
    run(kv, "other", list(range(50, 55)), priority=1)
    for rid in ("vip", "low", "other"):
        kv.free(rid)
    # The shared block's last user had priority 0, but it keeps the vip's 9.
    kv.allocate_slots("d", list(range(200, 220)), 0, 20)   # 4 free + 1 eviction
    assert kv.stats().evictions == 1
    assert kv.find_cached_prefix("e", prompt).num_tokens == 4
    assert kv.find_cached_prefix("e", list(range(50, 55))).num_tokens == 0


def priority_victims(events: list[tuple[str, str, str, int]]) -> list[str]:
    """Brute force over ("run" | "free", request, prompt, priority) events, each prompt one cached
    block: the free-cached blocks in the order the priority policy must evict them. A block's
    priority is the highest of the requests that held it since it last left the queue (its
    highest user, whichever came first); ties go to the block freed earliest."""
    holders: dict[str, set[str]] = {}
    highest: dict[str, int] = {}
    freed_at: dict[str, int] = {}
    for t, (op, rid, prompt, priority) in enumerate(events):
        users = holders.setdefault(prompt, set())
        if op == "run":
            if not users:
                highest[prompt] = priority
                freed_at.pop(prompt, None)
            highest[prompt] = max(highest[prompt], priority)
            users.add(rid)
        else:
            users.remove(rid)
            if not users:
                freed_at[prompt] = t
    return sorted(freed_at, key=lambda prompt: (highest[prompt], freed_at[prompt]))


@pytest.mark.parametrize("first,second", [(("low", 0), ("high", 9)), (("high", 9), ("low", 0))])
@pytest.mark.parametrize("free_order", list(itertools.permutations(range(4))))
def test_a_shared_block_takes_its_highest_users_priority_in_either_order(first, second, free_order):
    """A low- and a high-priority request share a block, in both orders, beside two other
    requests; every order of freeing them. The policy's queue and what eviction really drops
    follow the brute-force oracle: the later, higher-priority user raises the shared block."""
    prompts = {"shared": list(range(5)), "mid": list(range(50, 55)), "idle": list(range(80, 85))}
    requests = [(first[0], "shared", first[1]), (second[0], "shared", second[1]),
                ("mid", "mid", 5), ("idle", "idle", 0)]
    kv = make("priority", num_blocks=12)
    events = []
    for rid, prompt, priority in requests:
        run(kv, rid, prompts[prompt], priority=priority)
        events.append(("run", rid, prompt, priority))
    block_of = {prompt: kv.block_table(rid)[0] for rid, prompt, _ in requests}
    assert kv.block_table(first[0])[0] == kv.block_table(second[0])[0]
    for i in free_order:
        rid, prompt, priority = requests[i]
        kv.free(rid)
        events.append(("free", rid, prompt, priority))
    expected = priority_victims(events)
    prompt_of = {block: prompt for prompt, block in block_of.items()}
    assert [prompt_of[b] for b in kv.eviction_order()] == expected

    # Evict for real, one block at a time: each takes every free-uncached block plus one cached.
    for n, victim in enumerate(expected):
        tokens = list(range(1000 * (n + 1), 1000 * (n + 1) + 4 * (kv.stats().num_free_blocks + 1)))
        assert kv.allocate_slots(f"filler{n}", tokens, 0, len(tokens)) is not None
        kv.check_integrity()
        for prompt in expected:
            hit = kv.find_cached_prefix("probe", prompts[prompt]).num_tokens
            assert hit == (0 if prompt in expected[:n + 1] else 4), (victim, prompt)
