"""Eviction queues over free-cached blocks (ref 0, hash kept).

Every queue supports O(1) (LRU) or O(log n) amortised (LFU, priority) push, remove and pop.
Heap-based queues delete lazily: a removed block's heap entry stays until it reaches the top
or the heap is compacted, which keeps removal O(1) and never scans a list.
"""
from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from typing import Callable, Iterator, Optional

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
        return [block_id for _, block_id in self.keyed_order()]

    def peek(self) -> tuple[int, ...]:
        """The sort key of the next victim (the queue is not empty). Queues made with one
        `ticks` compare by these keys as if they were one queue (kv/tenant_shares.py)."""
        raise NotImplementedError

    def keyed_order(self) -> list[tuple[tuple[int, ...], int]]:
        """(sort key, block id) of every queued block, next victim first."""
        raise NotImplementedError


class LRUPolicy(EvictionPolicy):
    """Least recently freed first."""

    name = "lru"

    def __init__(self, ticks: Optional[Iterator[int]] = None) -> None:
        self._queue: OrderedDict[int, int] = OrderedDict()   # block id -> when it was freed
        self._ticks = ticks if ticks is not None else itertools.count()

    def push(self, block: Block) -> None:
        self._queue[block.block_id] = next(self._ticks)

    def remove(self, block_id: int) -> None:
        del self._queue[block_id]

    def pop(self) -> int:
        return self._queue.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._queue

    def peek(self) -> tuple[int, ...]:
        return (next(iter(self._queue.values())),)

    def keyed_order(self) -> list[tuple[tuple[int, ...], int]]:
        return [((tick,), block_id) for block_id, tick in self._queue.items()]


class _HeapPolicy(EvictionPolicy):
    """Smallest key first, ties least recently freed first."""

    def __init__(self, key: Callable[[Block], int], ticks: Optional[Iterator[int]] = None) -> None:
        self._key = key
        self._heap: list[tuple[int, int, int]] = []   # (key, seq, block_id)
        self._live: dict[int, int] = {}               # block_id -> seq of its valid entry
        self._ticks = ticks if ticks is not None else itertools.count(1)

    def push(self, block: Block) -> None:
        seq = next(self._ticks)
        self._live[block.block_id] = seq
        heapq.heappush(self._heap, (self._key(block), seq, block.block_id))
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

    def peek(self) -> tuple[int, ...]:
        heap, live = self._heap, self._live
        while live.get(heap[0][2]) != heap[0][1]:
            heapq.heappop(heap)   # a removed block's entry: dropped now rather than later
        return heap[0][:2]

    def keyed_order(self) -> list[tuple[tuple[int, ...], int]]:
        return [(e[:2], e[2]) for e in sorted(self._heap) if self._live.get(e[2]) == e[1]]


class LFUPolicy(_HeapPolicy):
    """Fewest uses first; ties least recently freed first."""

    name = "lfu"

    def __init__(self, ticks: Optional[Iterator[int]] = None) -> None:
        super().__init__(lambda block: block.uses, ticks)


class PriorityPolicy(_HeapPolicy):
    """Blocks last used by lower-priority requests go first; ties least recently freed first."""

    name = "priority"

    def __init__(self, ticks: Optional[Iterator[int]] = None) -> None:
        super().__init__(lambda block: block.priority, ticks)


_POLICIES: dict[str, Callable[[Optional[Iterator[int]]], EvictionPolicy]] = {
    "lru": LRUPolicy, "lfu": LFUPolicy, "priority": PriorityPolicy,
}


def make_policy(name: str, ticks: Optional[Iterator[int]] = None) -> EvictionPolicy:
    try:
        return _POLICIES[name](ticks)
    except KeyError:
        raise ValueError(f"eviction_policy must be one of {tuple(_POLICIES)}, got {name!r}") from None
