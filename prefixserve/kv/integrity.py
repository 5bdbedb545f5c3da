"""A full O(blocks + table entries) audit of the KV bookkeeping, for tests and debugging."""
from __future__ import annotations

from collections import Counter
from typing import Mapping

from prefixserve.kv.block import NO_PARENT
from prefixserve.kv.block_pool import BlockPool
from prefixserve.kv.hashing import BlockHasher
from prefixserve.kv.partial_blocks import is_partial
from prefixserve.kv.request_blocks import RequestBlocks


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


def check_integrity(pool: BlockPool, requests: Mapping[str, RequestBlocks],
                    pin_counts: Mapping[int, int], hasher: BlockHasher, block_size: int) -> None:
    blocks = pool.blocks
    total = len(blocks)

    free = pool.free_ids
    _check(len(set(free)) == len(free), "a block is on the free list twice")
    free_set = set(free)
    queued = 0
    for block in blocks:
        b = block.block_id
        _check(block.ref >= 0, f"block {b} has negative ref {block.ref}")
        in_queue = b in pool.policy
        queued += in_queue
        if block.ref > 0:
            _check(b not in free_set, f"block {b} is referenced ({block.ref}) but on the free list")
            _check(not in_queue, f"block {b} is referenced ({block.ref}) but evictable")
        elif block.hash is None:
            _check(b in free_set and not in_queue,
                   f"block {b} is free and uncached but not (only) on the free list")
        else:
            _check(in_queue and b not in free_set,
                   f"block {b} is free and cached but not (only) in the eviction queue")
    _check(queued == len(pool.policy), "the eviction queue holds blocks that are not in the pool")
    in_use = sum(1 for block in blocks if block.ref > 0)
    _check(len(free) + len(pool.policy) + in_use == total,
           f"free ({len(free)}) + cached free ({len(pool.policy)}) + in use ({in_use}) "
           f"!= total ({total})")

    hashed = 0
    for block in blocks:
        if block.hash is None:
            continue
        hashed += 1
        b = block.block_id
        _check(pool.index.get(block.hash) == b, f"block {b} has a hash the index does not map to it")
        tokens, parent_hash, extras = block.tokens, block.parent_hash, block.extras
        # a full block, or a token-exact breakpoint's partial block (partial_blocks.py)
        if tokens is None or not 0 < len(tokens) <= 4 * block_size or len(tokens) % 4:
            raise AssertionError(f"cached block {b} does not store between 1 and {block_size} tokens")
        if parent_hash is None or extras is None:
            raise AssertionError(f"cached block {b} does not store its parent hash and extra keys")
        recomputed = hasher.hash_encoded(parent_hash, tokens, extras)
        _check(recomputed == block.hash,
               f"block {b}: its stored tokens, parent hash and extra keys hash to "
               f"{recomputed.hex()}, not to its indexed hash {block.hash.hex()}")
        if block.parent == NO_PARENT:
            _check(block.parent_hash == hasher.seed, f"first block {b} is not chained to the seed")
        elif blocks[block.parent].gen == block.parent_gen:
            _check(blocks[block.parent].hash == block.parent_hash,
                   f"block {b} links to live parent {block.parent} whose hash differs")
    _check(hashed == len(pool.index), "the index maps hashes to blocks that do not hold them")
    _check_owners(pool)

    holders: Counter[int] = Counter()
    for rid, req in requests.items():
        _check(len(set(req.table)) == len(req.table), f"request {rid!r} holds a block twice")
        holders.update(req.table)
        _check(len(req.hashes) == len(req.canon) == len(req.canon_gen) <= len(req.table),
               f"request {rid!r}: hash chain bookkeeping does not match its table")
        for i, c in enumerate(req.canon):
            _check(c == NO_PARENT or blocks[c].gen != req.canon_gen[i]
                   or not is_partial(blocks[c].tokens, block_size),
                   f"request {rid!r}: block {i} of its chain is a partial block")
    holders.update(pin_counts)
    for block in blocks:
        _check(block.ref == holders.get(block.block_id, 0),
               f"block {block.block_id} has ref {block.ref} but "
               f"{holders.get(block.block_id, 0)} holders (tables + pins)")
    for b in pin_counts:
        _check(blocks[b].hash is not None, f"pinned block {b} is not cached")


def _check_owners(pool: BlockPool) -> None:
    """Every block in use or cached is charged to one owner (kv/tenant_shares.py), the pool's
    per-owner counts add up, and with shares each cached free block waits in its owner's queue."""
    held: Counter = Counter()
    for block in pool.blocks:
        if block.ref == 0 and block.hash is None:
            _check(block.owner is None, f"free uncached block {block.block_id} is still charged "
                                        f"to {block.owner!r}")
        else:
            held[block.owner] += 1
    _check(dict(held) == pool.held, f"blocks held per owner are {dict(held)}, the pool counts "
                                    f"{pool.held}")
    shares = pool.shares
    if shares is not None:
        for block in pool.blocks:
            if block.block_id in shares:
                _check(shares.owner_of(block.block_id) == block.owner,
                       f"cached block {block.block_id} of {block.owner!r} waits in the queue of "
                       f"{shares.owner_of(block.block_id)!r}")
