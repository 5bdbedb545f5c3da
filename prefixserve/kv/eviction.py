"""Eviction queues over free-cached blocks (ref 0, hash kept).

Every queue supports O(1) (LRU) or O(log n) amortised (LFU, priority) push, remove and pop.
Heap-based queues delete lazily: a removed block's heap entry stays until it reaches the top
or the heap is compacted, which keeps removal O(1) and never scans a list.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Callable

from prefixserve.kv.block import Block


class EvictionPolicy:
    name = ""

    def push(self, block: Block) -> None:
        """block has just become free-cached; it is the newest candidate."""
        raise NotImplementedError

    def remove(self, block_id: int) -> None:
        """block_id leaves the queue (taken back into use, or its hash dropped)."""
        raise NotImplementedError

    def pop(self) -> int:
        """Removes and returns the block to evict next."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __contains__(self, block_id: int) -> bool:
        raise NotImplementedError

    def order(self) -> list[int]:
        """Queued blocks, next victim first (for tests and diagnostics; O(n log n))."""
        raise NotImplementedError


class LRUPolicy(EvictionPolicy):
    """Least recently freed first."""

    name = "lru"

    def __init__(self) -> None:
        self._queue: OrderedDict[int, None] = OrderedDict()

    def push(self, block: Block) -> None:
        self._queue[block.block_id] = None

    def remove(self, block_id: int) -> None:
        del self._queue[block_id]

    def pop(self) -> int:
        return self._queue.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._queue

    def order(self) -> list[int]:
        return list(self._queue)


class _HeapPolicy(EvictionPolicy):
    """Smallest key first, ties least recently freed first."""

    def __init__(self, key: Callable[[Block], int]) -> None:
        self._key = key
        self._heap: list[tuple[int, int, int]] = []   # (key, seq, block_id)
        self._live: dict[int, int] = {}               # block_id -> seq of its valid entry
        self._seq = 0

    def push(self, block: Block) -> None:
        self._seq += 1
        self._live[block.block_id] = self._seq
        heapq.heappush(self._heap, (self._key(block), self._seq, block.block_id))
        # Lazy deletion leaves dead entries behind; rebuilding once they outnumber the live
        # ones keeps the heap O(live) and each operation amortised O(log n).
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [e for e in self._heap if self._live.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def remove(self, block_id: int) -> None:
        del self._live[block_id]

    def pop(self) -> int:
        heap, live = self._heap, self._live
        while True:
            _, seq, block_id = heapq.heappop(heap)
            if live.get(block_id) == seq:
                del live[block_id]
                return block_id

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._live

    def order(self) -> list[int]:
        return [e[2] for e in sorted(self._heap) if self._live.get(e[2]) == e[1]]


class LFUPolicy(_HeapPolicy):
    """Fewest uses first; ties least recently freed first."""

    name = "lfu"

    def __init__(self) -> None:
        super().__init__(lambda block: block.uses)


class PriorityPolicy(_HeapPolicy):
    """Blocks last used by lower-priority requests go first; ties least recently freed first."""

    name = "priority"

    def __init__(self) -> None:
        super().__init__(lambda block: block.priority)


_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy, "lfu": LFUPolicy, "priority": PriorityPolicy,
}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return _POLICIES[name]()
    except KeyError:
        raise ValueError(f"eviction_policy must be one of {tuple(_POLICIES)}, got {name!r}") from None
