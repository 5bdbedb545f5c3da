"""Token-exact breakpoints: the partial last block of a marked prefix, kept in the cache.

Full blocks are shared through their chained hash; a prefix that ends inside a block would lose
its last `t % block_size` tokens. For an explicit breakpoint at t, the block holding those tokens
is kept under H(parent hash, its t % block_size tokens, extra keys): the same message as a full
block's hash, whose token count field makes it differ from every full block's. Such a block is
immutable once cached: a request that hits it shares it, and its first write into the block (at
slot t % block_size, the first token after the breakpoint) copies it first, with the
copy-on-write that forks use. Its owner registers it only once the K/V up to t is computed (the
allocation after the one that reached t, or its free), so a hit never copies a block whose K/V
a forward has yet to write. It is evicted, pinned and audited like any cached block.
"""
from __future__ import annotations

from typing import Optional, Sequence

from prefixserve.kv.block import NO_PARENT
from prefixserve.kv.block_pool import BlockPool
from prefixserve.kv.hashing import BlockHash, BlockHasher, token_bytes
from prefixserve.kv.request_blocks import RequestBlocks


def is_partial(tokens: Optional[bytes], block_size: int) -> bool:
    """Whether a cached block's stored tokens are fewer than a block's."""
    return tokens is not None and len(tokens) < 4 * block_size


def pending_breakpoints(token_ids: Sequence[int], breakpoints: Sequence[int], block_size: int,
                        covered: int) -> list[tuple[int, bytes]]:
    """(t, tokens of t's block up to t) for each breakpoint not on a block boundary and past the
    `covered` tokens already cached, in order: what the request may register once computed."""
    return [(t, token_bytes(token_ids[t - t % block_size:t]))
            for t in sorted(set(breakpoints))
            if covered < t <= len(token_ids) and t % block_size]


def find_partial(pool: BlockPool, hasher: BlockHasher, ids: list[int], tokens: bytes,
                 extras: bytes) -> Optional[int]:
    """The cached partial block with these tokens after the chain `ids` (matched full blocks),
    proven by its stored tokens, extra keys and parent link, as full blocks are."""
    blocks = pool.blocks
    if ids:
        prev = blocks[ids[-1]]
        parent_hash, link, link_gen = prev.hash, prev.block_id, prev.gen
    else:
        parent_hash, link, link_gen = hasher.seed, NO_PARENT, 0
    if parent_hash is None:
        return None
    found = pool.index.get(hasher.hash_encoded(parent_hash, tokens, extras))
    if found is None:
        return None
    block = blocks[found]
    if (block.tokens != tokens or block.extras != extras or block.parent != link
            or block.parent_gen != link_gen):
        return None
    return found


PartialEntry = tuple  # the arguments of BlockPool.register for one partial block


def partial_entry(pool: BlockPool, hasher: BlockHasher, req: RequestBlocks, t: int,
                  tokens: bytes, block_size: int) -> Optional[PartialEntry]:
    """How to cache the request's block holding position t - 1 as the partial block of the
    prefix of t tokens (None: it cannot be), when the full blocks before it are in the index as
    this request's chain and no equal block is cached already. Changes nothing: the caller
    registers it (pool.register(*entry)) once it knows the K/V of the first t tokens is written."""
    q = t // block_size
    if len(req.hashes) < q or q >= len(req.table):
        return None   # the chain before it was not registered (caching off, a write limit)
    blocks = pool.blocks
    block_id = req.table[q]
    if blocks[block_id].hash is not None:
        return None
    if q:
        link, link_gen = req.canon[q - 1], req.canon_gen[q - 1]
        if link == NO_PARENT or blocks[link].gen != link_gen:
            return None   # the chain above was evicted or cut: no lookup could reach it
        parent_hash: BlockHash = req.hashes[q - 1]
        extras = req.extras_rest
    else:
        link, link_gen, parent_hash, extras = NO_PARENT, 0, hasher.seed, req.extras_first
    extras = req.special.get(q, extras)   # an image in the block keys it, as a full block's
    block_hash = hasher.hash_encoded(parent_hash, tokens, extras)
    if block_hash in pool.index:
        return None   # an equal partial block is cached (or a colliding block keeps its place)
    return (block_id, block_hash, tokens, extras, link, link_gen, parent_hash)
