"""The pool of physical blocks: states, the hash index and lazy eviction."""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

from prefixserve.kv.block import NO_PARENT, Block
from prefixserve.kv.eviction import EvictionPolicy
from prefixserve.kv.hashing import BlockHash
from prefixserve.kv.tenant_shares import Owner, TenantShares


class BlockPool:
    """All blocks exist from the start. Free-uncached blocks sit on a stack, free-cached ones in
    the eviction policy's queue, and in-use blocks in neither. Every operation is O(1) (O(log n)
    for heap-based policies): nothing scans or removes from the middle of a list."""

    def __init__(self, num_blocks: int, policy: EvictionPolicy) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Reversed so that a fresh pool hands out block 0 first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.policy = policy
        self.index: dict[BlockHash, int] = {}
        self.num_evictions = 0
        # (block id, hash, parent hash, tokens, extras) of each evicted block, for the KV stores
        # to copy out before the block is overwritten; None when no store is configured.
        self.evicted: Optional[list[tuple]] = None
        # A KVEventLog (kv/events.py) when someone outside watches what this pool holds.
        self.observer = None
        # Blocks in use or cached per owner (Block.owner), and each owner's cached blocks
        # evicted for someone's miss (its own included); owners with none are absent.
        self.held: dict[Owner, int] = {}
        self.evictions_of: dict[Owner, int] = {}
        # The policy itself when it keeps tenants' floors, else None.
        self.shares = policy if isinstance(policy, TenantShares) else None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Free blocks without a hash."""
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        """Free blocks that still hold a cached hash."""
        return len(self.policy)

    @property
    def num_available(self) -> int:
        return len(self._free) + len(self.policy)

    @property
    def free_ids(self) -> list[int]:
        return list(self._free)

    def num_available_for(self, owner: Owner, reclaim: Sequence[int] = ()) -> int:
        """Blocks a request of owner's could be handed now: free ones, and cached ones its
        miss may evict (all of them without shares), once the cached blocks in `reclaim` (a
        prefix hit's, leaving the queue) are taken out."""
        shares = self.shares
        if shares is None:
            return len(self._free) + len(self.policy) - sum(
                1 for b in reclaim if self.blocks[b].ref == 0)
        taken: dict[Owner, int] = {}
        for b in reclaim:
            if self.blocks[b].ref == 0:
                taken[self.blocks[b].owner] = taken.get(self.blocks[b].owner, 0) + 1
        return len(self._free) + shares.evictable_for(owner, self._allowance(owner), taken)

    def _allowance(self, owner: Owner) -> int:
        # How far below other tenants' floors owner's misses may evict: up to its own share.
        assert self.shares is not None
        return max(0, self.shares.floor(owner) - self.held.get(owner, 0))

    def allocate(self, count: int, priority: int, owner: Owner = None) -> list[int]:
        """Takes `count` blocks into use (ref 1) for owner, free-uncached ones first, then
        evicting cached ones. The caller checks num_available_for(owner) first."""
        allowance = self._allowance(owner) if self.shares is not None else 0
        free = self._free
        take = min(count, len(free))
        if take:
            ids = free[:-take - 1:-1]
            del free[-take:]
        else:
            ids = []
        for _ in range(count - take):
            if self.shares is None:
                ids.append(self._evict(self.policy.pop()))
            else:
                block_id, below_floor = self.shares.pop_for(owner, allowance)
                allowance -= below_floor
                ids.append(self._evict(block_id))
        blocks = self.blocks
        for block_id in ids:
            block = blocks[block_id]
            block.ref = 1
            block.uses = 1
            block.priority = priority
            block.owner = owner
        if ids:
            self.held[owner] = self.held.get(owner, 0) + len(ids)
        return ids

    def _evict(self, block_id: int) -> int:
        block = self.blocks[block_id]
        self._drop_holding(block.owner)
        self.evictions_of[block.owner] = self.evictions_of.get(block.owner, 0) + 1
        if self.evicted is not None:
            self.evicted.append((block_id, block.hash, block.parent_hash, block.tokens,
                                 block.extras))
        self._forget(block)
        self.num_evictions += 1
        return block_id

    def take(self, block_ids: Iterable[int], priority: int) -> None:
        """Cached blocks join a request's table (a prefix hit)."""
        blocks, remove = self.blocks, self.policy.remove
        for block_id in block_ids:
            block = blocks[block_id]
            if block.ref == 0:
                remove(block_id)
                block.priority = priority
            elif priority > block.priority:
                block.priority = priority
            block.ref += 1
            block.uses += 1

    def share(self, block_id: int) -> None:
        """One more holder of a block already in use (fork, pin)."""
        block = self.blocks[block_id]
        if block.ref == 0:
            self.policy.remove(block_id)
        block.ref += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drops one reference from each block, in the given order: blocks reaching ref 0 keep
        their hash and join the eviction queue in that order (unhashed ones are simply free)."""
        blocks, policy, free = self.blocks, self.policy, self._free
        for block_id in block_ids:
            block = blocks[block_id]
            block.ref -= 1
            if block.ref == 0:
                if block.hash is not None:
                    policy.push(block)
                else:
                    free.append(block_id)
                    self._drop_holding(block.owner)
                    block.owner = None

    def register(self, block_id: int, block_hash: BlockHash, tokens: bytes, extras: bytes,
                 parent: int, parent_gen: int, parent_hash: BlockHash) -> None:
        """Puts an in-use, unhashed block into the index; the hash must be free in the index."""
        block = self.blocks[block_id]
        block.hash = block_hash
        block.tokens = tokens
        block.extras = extras
        block.parent = parent
        block.parent_gen = parent_gen
        block.parent_hash = parent_hash
        self.index[block_hash] = block_id
        if self.observer is not None:
            self.observer.stored(block_hash)

    def uncache(self, block_id: int) -> None:
        """Drops a block's hash; a free-cached block becomes free-uncached."""
        block = self.blocks[block_id]
        if block.ref == 0:
            self.policy.remove(block_id)
            self._free.append(block_id)
            self._drop_holding(block.owner)
            block.owner = None
        self._forget(block)

    def _drop_holding(self, owner: Owner) -> None:
        count = self.held[owner] - 1
        if count:
            self.held[owner] = count
        else:
            del self.held[owner]

    def _forget(self, block: Block) -> None:
        if block.hash is None:
            raise ValueError(f"block {block.block_id} is not cached: it has no hash to forget")
        del self.index[block.hash]
        if self.observer is not None:
            self.observer.removed(block.hash)
        block.hash = None
        block.tokens = None
        block.extras = None
        block.parent = NO_PARENT
        block.parent_gen = 0
        block.parent_hash = None
        block.gen += 1

    def reset(self) -> int:
        """Drops every hash; returns how many were dropped."""
        dropped = list(self.index.values())
        for block_id in dropped:
            self.uncache(block_id)
        if self.observer is not None:
            self.observer.cleared()
        return len(dropped)
