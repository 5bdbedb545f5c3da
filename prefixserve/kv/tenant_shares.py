"""Cache shares: each tenant's cached blocks keep a floor that other tenants' misses respect.

A block is charged to the tenant whose request allocated it (`Block.owner`, kept while the block
is cached, cleared when it becomes free and uncached). Blocks are shared only within one cache
namespace, which is one tenant's, or the anonymous one that every request without a keys file
shares; a hit never moves the charge, so a block shared by several requests counts once, for the
tenant that wrote it.

Each owner's free-cached blocks wait in an eviction queue of their own, all queues drawing their
order from one clock, so that merged they order exactly like the single queue they replace. A
tenant's share is its weight's part of the pool; its floor is that many of its free-cached
blocks. Tenant X's miss evicts, in the merged order, from X's own queue and from any other
queue above its floor; it may reach below another's floor only while X holds (cached or in use)
fewer blocks than its own share, and only up to that share. Within one queue the pool's policy
(LRU, LFU, priority) decides, as without shares.
"""
from __future__ import annotations

import itertools
from typing import Iterable, Mapping, Optional

from prefixserve.kv.block import Block
from prefixserve.kv.eviction import EvictionPolicy, make_policy

Owner = Optional[str]


def block_shares(num_blocks: int, weights: Iterable[tuple[str, float]]) -> dict[str, int]:
    """Each weighted tenant's share of the pool, in blocks (rounded down)."""
    pairs = list(weights)
    total = sum(w for _, w in pairs)
    return {name: int(num_blocks * w / total) for name, w in pairs}


class TenantShares(EvictionPolicy):
    """The pool's eviction queue split by owner, with floors (see the module's docstring)."""

    name = "shares"

    def __init__(self, policy: str, shares: Mapping[str, int]) -> None:
        self._policy = policy
        self._ticks = itertools.count(1)
        self._queues: dict[Owner, EvictionPolicy] = {}
        self._owner_of: dict[int, Owner] = {}
        self.shares = dict(shares)

    def floor(self, owner: Owner) -> int:
        return self.shares.get(owner, 0) if owner is not None else 0

    def queued(self, owner: Owner) -> int:
        """owner's free-cached blocks."""
        queue = self._queues.get(owner)
        return len(queue) if queue is not None else 0

    def owner_of(self, block_id: int) -> Owner:
        return self._owner_of[block_id]

    def push(self, block: Block) -> None:
        queue = self._queues.get(block.owner)
        if queue is None:
            queue = self._queues[block.owner] = make_policy(self._policy, self._ticks)
        queue.push(block)
        self._owner_of[block.block_id] = block.owner

    def remove(self, block_id: int) -> None:
        owner = self._owner_of.pop(block_id)
        queue = self._queues[owner]
        queue.remove(block_id)
        if not len(queue):
            del self._queues[owner]

    def pop(self) -> int:
        """The next victim in the merged order, floors aside."""
        return self.pop_for(None, len(self._owner_of))[0]

    def pop_for(self, owner: Owner, allowance: int) -> tuple[int, bool]:
        """The next victim for a miss of owner's: (block id, whether it came from below another
        tenant's floor, which costs one of `allowance`)."""
        best: Optional[tuple[tuple[int, ...], Owner, bool]] = None
        for other, queue in self._queues.items():
            below = other != owner and len(queue) <= self.floor(other)
            if below and allowance <= 0:
                continue
            key = queue.peek()
            if best is None or key < best[0]:
                best = (key, other, below)
        if best is None:
            raise RuntimeError(f"no block may be evicted for {owner!r}: the caller must check "
                               "num_available_for first")
        _, other, below = best
        queue = self._queues[other]
        block_id = queue.pop()
        del self._owner_of[block_id]
        if not len(queue):
            del self._queues[other]
        return block_id, below

    def evictable_for(self, owner: Owner, allowance: int, reclaim: Mapping[Owner, int]) -> int:
        """How many free-cached blocks a miss of owner's may evict, with `reclaim` of each owner's
        queued blocks taken out first (a prefix hit's)."""
        free, protected = 0, 0
        for other, queue in self._queues.items():
            count = len(queue) - reclaim.get(other, 0)
            if other == owner:
                free += count
            else:
                floor = min(count, self.floor(other))
                free += count - floor
                protected += floor
        return free + min(allowance, protected)

    def __len__(self) -> int:
        return len(self._owner_of)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._owner_of

    def keyed_order(self) -> list[tuple[tuple[int, ...], int]]:
        return sorted(entry for queue in self._queues.values() for entry in queue.keyed_order())
