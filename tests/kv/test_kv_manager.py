"""KV cache manager: prefix lookup rules, allocation, registration, fork/copy-on-write, stats."""
import pytest

from prefixserve.kv import KVCacheConfig, KVCacheManager, PrefixHit


def make(num_blocks=16, block_size=16, **kwargs):
    hash_fn = kwargs.pop("hash_fn", None)
    return KVCacheManager(KVCacheConfig(num_blocks=num_blocks, block_size=block_size, **kwargs),
                          hash_fn=hash_fn)


def run(kv, rid, tokens, salt=None, preempted=False, priority=0):
    """Admits a request the way the scheduler does: lookup, then allocate the rest."""
    hit = kv.find_cached_prefix(rid, tokens, cache_salt=salt, preempted=preempted)
    alloc = kv.allocate_slots(rid, tokens, hit.num_tokens, len(tokens) - hit.num_tokens, hit=hit,
                              cache_salt=salt, priority=priority)
    kv.check_integrity()
    return hit, alloc


def test_entirely_cached_prompt_recomputes_exactly_one_block():
    kv = make()
    prompt = list(range(100, 132))
    run(kv, "a", prompt)
    first_block = kv.block_table("a")[0]
    kv.free("a")
    hit, alloc = run(kv, "b", prompt)
    assert hit.num_tokens == 16 and hit.block_ids == [first_block]
    assert len(alloc.new_block_ids) == 1     # tokens 16..31 are computed again
    assert kv.block_table("b") == [first_block] + alloc.new_block_ids


def test_last_token_is_never_a_hit():
    kv = make()
    run(kv, "a", list(range(16)))
    kv.free("a")
    assert kv.find_cached_prefix("b", list(range(16))).num_tokens == 0
    assert kv.find_cached_prefix("b", list(range(17))).num_tokens == 16


def test_prompt_shorter_than_a_block_never_hits_and_is_never_registered():
    kv = make()
    run(kv, "a", [1, 2, 3])
    kv.free("a")
    assert kv.find_cached_prefix("b", [1, 2, 3]).num_tokens == 0
    assert kv.find_cached_prefix("b", [1, 2, 3] + list(range(20))).num_tokens == 0
    assert kv.stats().num_cached_blocks == 0


def test_lookup_stops_at_first_miss_and_first_token_matters():
    kv = make(block_size=4)
    prompt = list(range(20))
    run(kv, "a", prompt)
    kv.free("a")
    assert kv.find_cached_prefix("b", [99] + prompt[1:]).num_tokens == 0
    # Block 1 differs: blocks 2.. cannot hit even though their tokens match.
    middle = prompt[:5] + [99] + prompt[6:]
    assert kv.find_cached_prefix("b", middle).num_tokens == 4
    assert kv.find_cached_prefix("b", prompt + [1]).num_tokens == 20


def test_salts_never_share_and_same_salt_shares():
    kv = make()
    prompt = list(range(40))
    run(kv, "a", prompt, salt="alice")
    assert kv.find_cached_prefix("b", prompt, cache_salt="bob").num_tokens == 0
    assert kv.find_cached_prefix("b", prompt).num_tokens == 0
    assert kv.find_cached_prefix("b", prompt, cache_salt="alice").num_tokens == 32
    run(kv, "c", prompt)
    assert kv.find_cached_prefix("d", prompt, cache_salt="alice").num_tokens == 32
    assert kv.find_cached_prefix("d", prompt).num_tokens == 32
    assert set(kv.block_table("a")).isdisjoint(kv.block_table("c"))


def test_forced_hash_collision_never_gives_a_wrong_hit():
    kv = make(num_blocks=64, block_size=2, hash_fn=lambda data: b"same")
    contents = {}    # physical block -> the prefix (salt, tokens) whose K/V it holds
    prompts = [[1, 2, 3, 4, 5], [1, 2, 3, 9, 9], [2, 1, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7],
               [3, 3, 3, 3, 3], [1, 2, 3, 4, 5]]
    hits = 0
    for i, prompt in enumerate(prompts * 3):
        salt = "s" if i % 4 == 3 else None
        hit, _ = run(kv, f"r{i}", prompt, salt=salt)
        for j, block in enumerate(hit.block_ids):
            assert contents[block] == (salt, tuple(prompt[:2 * j + 2]))
        hits += hit.num_tokens
        for j, block in enumerate(kv.block_table(f"r{i}")):
            contents[block] = (salt, tuple(prompt[:2 * j + 2]))
        if i % 2:
            kv.free(f"r{i}")
    assert hits > 0    # collisions cost misses, not every hit


def test_forced_collision_with_repeated_blocks_never_reuses_a_block_for_another_position():
    # Every block of [5] * 7 has the same tokens and, here, the same hash: only the parent link
    # tells position 0 from position 1.
    kv = make(num_blocks=8, block_size=2, hash_fn=lambda data: b"same")
    run(kv, "a", [5] * 7)
    table = kv.block_table("a")
    kv.free("a")
    hit = kv.find_cached_prefix("b", [5] * 7)
    assert hit.block_ids == table[:len(hit.block_ids)]
    assert len(set(hit.block_ids)) == len(hit.block_ids)


def test_blocks_are_shared_within_the_same_step_and_chunk_by_chunk():
    kv = make(block_size=4)
    prompt = list(range(30))
    hit_a = kv.find_cached_prefix("a", prompt)
    kv.allocate_slots("a", prompt, 0, 12, hit=hit_a)      # first chunk: blocks 0-2 full
    hit_b = kv.find_cached_prefix("b", prompt)             # same step, before any forward
    assert hit_b.block_ids == kv.block_table("a")[:3]
    kv.allocate_slots("b", prompt, 12, 10, hit=hit_b)
    assert kv.block_table("b")[:3] == kv.block_table("a")[:3]
    kv.check_integrity()


def test_prefix_caching_off_never_hits_or_registers():
    kv = make(enable_prefix_caching=False, block_size=4)
    prompt = list(range(20))
    run(kv, "a", prompt)
    kv.free("a")
    hit, _ = run(kv, "b", prompt)
    assert hit.num_tokens == 0
    stats = kv.stats()
    assert stats.num_cached_blocks == 0 and stats.num_cached_free_blocks == 0
    kv.free("b")
    assert kv.stats().num_free_blocks == 16


def test_failed_allocation_changes_nothing():
    kv = make(num_blocks=4, block_size=4)
    prompt = list(range(13))
    run(kv, "a", prompt)        # 4 blocks, 3 of them cached
    kv.free("a")

    def snapshot():
        return kv.stats(), kv.eviction_order(), kv.block_table("b")
    before = snapshot()
    # Hits 3 blocks (leaving the eviction queue) and needs 2 more: only 1 is free.
    longer = prompt + [50, 51, 52, 53, 54]
    hit = kv.find_cached_prefix("b", longer)
    assert hit.num_tokens == 12
    assert kv.allocate_slots("b", longer, 12, 6, hit=hit) is None
    assert snapshot() == before and not kv.has_request("b")
    kv.check_integrity()
    # A fresh prompt needing 5 blocks fails too; 4 succeeds by evicting all cached blocks.
    assert kv.allocate_slots("c", list(range(100, 120)), 0, 20) is None
    assert snapshot() == before
    assert kv.allocate_slots("c", list(range(100, 116)), 0, 16) is not None
    assert kv.stats().evictions == 3
    kv.check_integrity()


def test_free_uncached_blocks_go_before_cached_ones():
    kv = make(num_blocks=8, block_size=4)
    run(kv, "a", list(range(9)))      # 3 blocks, 2 cached
    kv.free("a")
    kv.allocate_slots("b", list(range(50, 70)), 0, 20)   # 5 blocks: exactly the uncached ones
    assert kv.stats().evictions == 0
    assert kv.find_cached_prefix("c", list(range(9))).num_tokens == 8


def test_fork_shares_every_block_and_copies_on_first_write():
    kv = make(block_size=4)
    prompt = list(range(10))
    run(kv, "p", prompt)
    kv.fork("p", "c")
    table = kv.block_table("p")
    assert kv.block_table("c") == table and len(table) == 3
    kv.check_integrity()
    # The parent writes token 10 into the shared partial block 2: it gets a copy.
    alloc = kv.allocate_slots("p", prompt + [7], 10, 1)
    assert alloc.new_block_ids == []
    assert len(alloc.copies) == 1 and alloc.copies[0][0] == table[2]
    dst = alloc.copies[0][1]
    assert kv.block_table("p") == table[:2] + [dst] and kv.block_table("c") == table
    # The child is now the only holder: it writes in place.
    assert kv.allocate_slots("c", prompt + [8], 10, 1).copies == []
    assert kv.stats().cow_copies == 1
    kv.check_integrity()


def test_fork_at_a_block_boundary_needs_no_copy():
    kv = make(block_size=4)
    prompt = list(range(8))
    run(kv, "p", prompt)
    kv.fork("p", "c")
    alloc = kv.allocate_slots("c", prompt + [1], 8, 1)
    assert alloc.copies == [] and len(alloc.new_block_ids) == 1
    assert kv.block_table("c")[:2] == kv.block_table("p")


def test_identical_forked_samples_stay_findable():
    # Greedy n > 1: both samples fill equal blocks; the second is a duplicate of the first.
    kv = make(block_size=4)
    prompt = list(range(6))
    run(kv, "p", prompt)
    kv.fork("p", "c")
    seq = list(prompt)
    for token in (20, 21, 22, 23, 24, 25):
        seq.append(token)
        for rid in ("p", "c"):
            assert kv.allocate_slots(rid, seq, len(seq) - 1, 1) is not None
            kv.check_integrity()
    assert kv.find_cached_prefix("x", seq + [0]).num_tokens == 12
    kv.free("p")
    kv.free("c")
    assert kv.find_cached_prefix("x", seq + [0]).num_tokens == 12
    assert kv.stats().num_used_blocks == 0
    kv.check_integrity()


def test_stats_count_tokens_and_keep_recomputed_apart():
    kv = make(block_size=4)
    prompt = list(range(10))
    run(kv, "a", prompt)
    run(kv, "b", prompt)
    kv.free("b")
    run(kv, "b", prompt, preempted=True)
    s = kv.stats()
    assert (s.queries, s.query_tokens, s.hit_tokens) == (2, 20, 8)
    assert (s.recomputed_queries, s.recomputed_query_tokens, s.recomputed_hit_tokens) == (1, 10, 8)
    assert s.num_used_blocks + s.num_free_blocks + s.num_cached_free_blocks == s.num_blocks
    assert s.num_requests == 2


def test_decode_registers_blocks_as_they_fill():
    kv = make(block_size=4)
    seq = [1, 2, 3]
    run(kv, "a", seq)
    for token in (4, 5, 6, 7, 8):
        seq.append(token)
        kv.allocate_slots("a", seq, len(seq) - 1, 1)
    assert kv.find_cached_prefix("b", seq + [9]).num_tokens == 8


def test_all_blocks_free_after_every_request_ends():
    kv = make(num_blocks=12, block_size=4)
    for i in range(5):
        run(kv, f"r{i}", list(range(i, i + 10)))
    kv.fork("r0", "r0b")
    for rid in ("r0", "r1", "r2", "r3", "r4", "r0b", "unknown"):
        kv.free(rid)
    s = kv.stats()
    assert s.num_used_blocks == 0 and s.num_free_blocks + s.num_cached_free_blocks == 12
    kv.check_integrity()


def test_reset_prefix_cache_drops_every_hash():
    kv = make(block_size=4)
    run(kv, "a", list(range(9)))
    run(kv, "b", list(range(50, 59)))
    kv.free("b")
    assert kv.reset_prefix_cache() == 4
    assert kv.find_cached_prefix("c", list(range(9))).num_tokens == 0
    assert kv.find_cached_prefix("c", list(range(50, 59))).num_tokens == 0
    assert kv.stats().num_cached_free_blocks == 0
    kv.check_integrity()


def test_misuse_is_reported_clearly():
    kv = make(block_size=4)
    prompt = list(range(10))
    run(kv, "a", prompt)
    with pytest.raises(ValueError, match="already holds blocks"):
        kv.find_cached_prefix("a", prompt)
    with pytest.raises(ValueError, match="token_ids has"):
        kv.allocate_slots("a", prompt, 10, 5)
    with pytest.raises(ValueError, match="must equal the hit"):
        kv.allocate_slots("b", prompt, 4, 6)
    with pytest.raises(ValueError, match="unknown request"):
        kv.fork("zz", "yy")
    with pytest.raises(ValueError, match="already holds blocks"):
        kv.fork("a", "a")


def test_bad_input_to_allocate_leaves_no_trace():
    kv = make(block_size=4)
    before = kv.stats()
    with pytest.raises(ValueError, match="token ids"):
        kv.allocate_slots("a", [1, 2, 3, -4, 5], 0, 5)
    with pytest.raises(ValueError, match="cache_salt"):
        kv.allocate_slots("a", [1, 2, 3, 4, 5], 0, 5, cache_salt=7)
    assert kv.stats() == before and not kv.has_request("a")
    kv.check_integrity()


def test_stale_hit_is_refused():
    kv = make(num_blocks=3, block_size=4)
    prompt = list(range(9))
    run(kv, "a", prompt)
    kv.free("a")
    hit = kv.find_cached_prefix("b", prompt)
    kv.allocate_slots("c", list(range(100, 112)), 0, 12)   # evicts the hit's blocks
    with pytest.raises(ValueError, match="stale"):
        kv.allocate_slots("b", prompt, hit.num_tokens, 1, hit=hit)
    assert isinstance(hit, PrefixHit)


def test_num_blocks_needed_and_can_allocate():
    kv = make(num_blocks=4, block_size=4)
    assert kv.num_blocks_needed("a", 9) == 3
    kv.allocate_slots("a", list(range(5)), 0, 5)
    assert kv.num_blocks_needed("a", 9) == 1
    assert kv.can_allocate(2) and not kv.can_allocate(3)


def test_same_model_identity_gives_the_same_hashes_in_two_managers():
    a = make(block_size=4, model_identity="m@1")
    b = make(block_size=4, model_identity="m@1")
    prompt = list(range(9))
    run(a, "x", prompt)
    cached = {a._pool.blocks[blk].hash for blk in a.block_table("x")[:2]}
    assert cached == set(b.hasher.hash_prompt(prompt, 4))


def test_check_integrity_detects_corruption():
    kv = make(block_size=4)
    run(kv, "a", list(range(9)))
    kv.check_integrity()
    block = kv._pool.blocks[kv.block_table("a")[0]]
    block.ref += 1
    with pytest.raises(AssertionError, match="holders"):
        kv.check_integrity()
    block.ref -= 1
    block.tokens = bytes(len(block.tokens))
    with pytest.raises(AssertionError, match="hash to"):
        kv.check_integrity()


def test_rewind_drops_only_the_hashes_of_the_lost_tokens():
    kv = make(block_size=4)
    prompt = list(range(10))
    run(kv, "a", prompt)                      # blocks 0, 1 registered; block 2 partial
    table_before = kv.block_table("a")
    # A step schedules 7 more tokens: block 2 fills and block 3 fills, block 4 is new.
    more = prompt + list(range(50, 57))
    alloc = kv.allocate_slots("a", more, 10, 7)
    assert len(alloc.new_block_ids) == 2
    # Another request of the same step reuses what this one is filling.
    hit, _ = run(kv, "b", more[:16] + [99])
    assert hit.num_tokens == 16
    assert kv.stats().num_cached_blocks == 4
    # That step failed: both go back (b, admitted in it, is freed; a to its 10 tokens).
    kv.rewind("b", 16)
    kv.free("b")
    kv.rewind("a", 10)
    kv.check_integrity()
    assert kv.block_table("a") == table_before
    assert kv.stats().num_cached_blocks == 2  # blocks 0 and 1, written before that step
    assert kv.find_cached_prefix("c", more).num_tokens == 8
    # The same tokens scheduled again are registered again.
    kv.allocate_slots("a", more, 10, 7)
    kv.check_integrity()
    assert kv.stats().num_cached_blocks == 4
    kv.free("a")
    kv.check_integrity()
    assert kv.stats().num_used_blocks == 0


def test_rewind_keeps_hashes_another_request_registered():
    kv = make(block_size=4)
    shared = list(range(8))
    run(kv, "first", shared + [1])            # registers both blocks of `shared`
    # "second" computes the same tokens without hitting (admitted at 0), so its blocks are
    # equal copies and the first request's registrations stay the ones lookups find.
    kv.allocate_slots("second", shared + [2], 0, 9)
    assert kv.stats().num_cached_blocks == 2
    kv.rewind("second", 0)
    kv.check_integrity()
    assert kv.block_table("second") == []
    assert kv.find_cached_prefix("third", shared + [3]).num_tokens == 8
    kv.free("second")
    kv.free("first")
    with pytest.raises(ValueError, match="unknown"):
        kv.rewind("first", 0)
