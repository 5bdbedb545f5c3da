"""The KV manager's side of the stores, without a model: what it asks the stores for, how
imported blocks join the index, and what it reports as evicted. Oracles: the hasher run
independently, the manager's own integrity invariants, and its ordinary prefix lookup."""
from __future__ import annotations

import random

from prefixserve.kv import KVCacheConfig, KVCacheManager
from prefixserve.kv.hashing import BlockHasher, encode_extra_keys, token_bytes

BS = 4


def manager(num_blocks: int = 16) -> KVCacheManager:
    kv = KVCacheManager(KVCacheConfig(num_blocks=num_blocks, block_size=BS, model_identity="m"))
    kv.enable_store_journal(write_through=False)
    return kv


def run_request(kv: KVCacheManager, rid: str, tokens: list[int]) -> None:
    hit = kv.find_cached_prefix(rid, tokens)
    assert kv.allocate_slots(rid, tokens, hit.num_tokens, len(tokens) - hit.num_tokens, hit=hit)
    kv.free(rid)


def test_the_lookup_asks_for_every_block_past_the_pool_hit():
    kv = manager()
    tokens = list(range(100, 118))          # 4 full blocks + 2 tokens
    run_request(kv, "a", tokens[:8])         # the pool holds the first 2 blocks
    lookup = kv.store_lookup(tokens, max_blocks=10)
    assert len(lookup.prefix_ids) == 2
    hashes = BlockHasher("xxh3_64", "m").hash_prompt(tokens, BS)
    assert [c.block_hash for c in lookup.candidates] == hashes[2:4]
    assert [c.parent_hash for c in lookup.candidates] == hashes[1:3]
    assert [c.tokens for c in lookup.candidates] == [token_bytes(tokens[8:12]), token_bytes(tokens[12:16])]
    assert kv.store_lookup(tokens, max_blocks=1).candidates == lookup.candidates[:1]
    # The block of the last token is never asked for: its logits must be computed.
    assert kv.store_lookup(tokens[:16], max_blocks=10).candidates == lookup.candidates[:1]


def test_salted_chains_carry_the_salt_in_the_first_block_only():
    kv = manager()
    lookup = kv.store_lookup(list(range(9)), cache_salt="t", max_blocks=10)
    assert lookup.candidates[0].extras == encode_extra_keys((("salt", "t"),))
    assert lookup.candidates[1].extras == encode_extra_keys(())
    assert lookup.candidates[0].parent_hash == BlockHasher("xxh3_64", "m").seed


def test_imported_blocks_are_ordinary_hits_and_keep_the_invariants():
    rng = random.Random(0)
    for trial in range(200):
        kv = manager(num_blocks=rng.randint(3, 12))
        prompts = [[rng.randrange(50) for _ in range(rng.randint(1, 30))] for _ in range(4)]
        for i, p in enumerate(prompts[:2]):
            if -(-len(p) // BS) <= kv.num_blocks:
                run_request(kv, f"r{i}", p)
        target = prompts[3]
        lookup = kv.store_lookup(target, max_blocks=rng.randint(0, 8))
        ids = kv.import_blocks(lookup, rng.randint(0, len(lookup.candidates)))
        kv.check_integrity()
        hit = kv.find_cached_prefix("t", target)
        # The pool hit the lookup saw, then every imported block, in chain order.
        assert hit.block_ids == lookup.prefix_ids + ids, trial
        for block_id, meta in zip(ids, lookup.candidates):
            assert kv.cached_blocks()[[b for b, _ in kv.cached_blocks()].index(block_id)][1] == meta
        assert kv.stats().num_used_blocks == 0


def test_making_room_for_an_import_never_evicts_the_prefix_it_extends():
    kv = manager(num_blocks=6)
    run_request(kv, "a", list(range(9)))        # blocks 0-1 cached (2 full blocks)
    run_request(kv, "b", list(range(50, 59)))   # 2 more, newer
    lookup = kv.store_lookup(list(range(9)) + list(range(20, 40)), max_blocks=10)
    assert len(lookup.prefix_ids) == 2
    ids = kv.import_blocks(lookup, 10)
    assert len(ids) == 4                         # all the pool has besides the prefix
    assert kv.find_cached_prefix("x", list(range(9)) + list(range(20, 40))).block_ids == \
        lookup.prefix_ids + ids
    kv.check_integrity()


def test_evicted_blocks_are_reported_with_what_made_their_hash():
    kv = manager(num_blocks=4)
    hasher = BlockHasher("xxh3_64", "m")
    run_request(kv, "a", list(range(13)))        # 3 full blocks cached
    run_request(kv, "b", list(range(60, 76)))    # 4 blocks: evicts a's cached ones
    evicted = kv.take_evicted()
    assert evicted
    for _, meta in evicted:
        assert hasher.hash_encoded(meta.parent_hash, meta.tokens, meta.extras) == meta.block_hash
    assert kv.take_evicted() == []
