"""Pins: explicit holds on cached prefix blocks, with optional expiry, a cap on all pins and a
cap on each tenant's.

The per-tenant cap is what keeps one tenant of a shared server from taking the whole pinned
share of the pool, which would refuse every other tenant's pins until its own expired. A
tenant's blocks are the distinct blocks its pins hold; pins are charged to the tenant that
placed them (refreshing another's pin charges nothing).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Optional

from prefixserve.errors import PinLimitError


@dataclass
class PinInfo:
    pin_id: Optional[str]         # None: nothing was cached, so nothing was pinned
    block_ids: list[int]
    num_tokens: int
    expires_at: Optional[float]   # clock() time; None = until unpinned


@dataclass
class _Pin:
    block_ids: tuple[int, ...]
    num_tokens: int
    expires_at: Optional[float]
    seq: int   # identifies the pin's current entry in the expiry heap
    tenant: Optional[str] = None

    def info(self, pin_id: str) -> PinInfo:
        return PinInfo(pin_id, list(self.block_ids), self.num_tokens, self.expires_at)


class PinRegistry:
    """Which pins exist and which blocks they hold. The manager turns each pin into one
    reference on each of its blocks, so a pinned block is in use and never evictable."""

    def __init__(self, max_pinned_blocks: Optional[int], max_pinned_blocks_per_tenant: Optional[int] = None,
                 on_remove: Optional[Callable[[str], None]] = None) -> None:
        self.max_pinned_blocks = max_pinned_blocks
        self.max_pinned_blocks_per_tenant = max_pinned_blocks_per_tenant
        # called with the id of every pin that goes (unpinned, expired or cleared)
        self.on_remove = on_remove
        self._pins: dict[str, _Pin] = {}
        self._by_blocks: dict[tuple[int, ...], str] = {}
        self._block_pins: dict[int, int] = {}   # block id -> number of live pins holding it
        # tenant -> block id -> number of the tenant's live pins holding it
        self._tenant_blocks: dict[Optional[str], dict[int, int]] = {}
        self._expiry: list[tuple[float, int, str]] = []
        self._seq = 0

    @property
    def num_pinned_blocks(self) -> int:
        return len(self._block_pins)

    @property
    def may_expire(self) -> bool:
        """Whether any pin has (or had, lazily) an expiry: only then is the clock read."""
        return bool(self._expiry)

    def pin_counts(self) -> dict[int, int]:
        return dict(self._block_pins)

    def num_tenant_blocks(self, tenant: Optional[str]) -> int:
        return len(self._tenant_blocks.get(tenant, ()))

    def find(self, block_ids: tuple[int, ...]) -> Optional[str]:
        return self._by_blocks.get(block_ids)

    def check_cap(self, block_ids: tuple[int, ...], tenant: Optional[str] = None) -> None:
        if self.max_pinned_blocks is not None:
            new = sum(1 for b in block_ids if b not in self._block_pins)
            total = len(self._block_pins) + new
            if total > self.max_pinned_blocks:
                raise PinLimitError(
                    f"pinning {len(block_ids)} blocks ({new} not yet pinned) would pin {total} blocks; "
                    f"max_pinned_blocks is {self.max_pinned_blocks}. Unpin something first.")
        cap = self.max_pinned_blocks_per_tenant
        if cap is not None:
            held = self._tenant_blocks.get(tenant, {})
            total = len(held) + sum(1 for b in block_ids if b not in held)
            if total > cap:
                raise PinLimitError(
                    f"pinning {len(block_ids)} blocks would make this tenant's pins hold {total} blocks; "
                    f"each tenant may pin {cap}. Unpin or delete one of its pins first.",
                    code="tenant_pin_limit")

    def add(self, block_ids: tuple[int, ...], num_tokens: int,
            expires_at: Optional[float], tenant: Optional[str] = None) -> PinInfo:
        self._seq += 1
        pin_id = f"pin-{self._seq}"
        pin = _Pin(block_ids, num_tokens, expires_at, self._seq, tenant)
        self._pins[pin_id] = pin
        self._by_blocks[block_ids] = pin_id
        held = self._tenant_blocks.setdefault(tenant, {})
        for b in block_ids:
            self._block_pins[b] = self._block_pins.get(b, 0) + 1
            held[b] = held.get(b, 0) + 1
        if expires_at is not None:
            self._push_expiry(expires_at, pin.seq, pin_id)
        return pin.info(pin_id)

    def _push_expiry(self, expires_at: float, seq: int, pin_id: str) -> None:
        heap = self._expiry
        heapq.heappush(heap, (expires_at, seq, pin_id))
        # Every refresh leaves its old entry behind until that entry's time comes, so a hot
        # prefix with a long TTL would grow the heap by one entry a hit: rebuild it from the live
        # entries once the stale ones outnumber them.
        if len(heap) > 2 * len(self._pins) + 64:
            self._expiry = [(p.expires_at, p.seq, pid) for pid, p in self._pins.items()
                            if p.expires_at is not None]
            heapq.heapify(self._expiry)

    def refresh(self, pin_id: str, expires_at: Optional[float], *, shorten: bool = False) -> PinInfo:
        """Moves a pin's expiry to expires_at, but never earlier unless shorten is set: a short
        TTL hit must not cut short a longer-lived pin of the same prefix."""
        pin = self._pins[pin_id]
        if not shorten and (pin.expires_at is None or
                            (expires_at is not None and expires_at < pin.expires_at)):
            return pin.info(pin_id)
        self._seq += 1
        pin.seq = self._seq
        pin.expires_at = expires_at
        if expires_at is not None:
            self._push_expiry(expires_at, pin.seq, pin_id)
        return pin.info(pin_id)

    def remove(self, pin_id: str) -> Optional[tuple[int, ...]]:
        """Forgets a pin; returns the blocks it held (None if no such pin)."""
        pin = self._pins.pop(pin_id, None)
        return None if pin is None else self._release(pin_id, pin)

    def _release(self, pin_id: str, pin: _Pin) -> tuple[int, ...]:
        """Forgets the blocks and charges of a pin already taken out of self._pins."""
        del self._by_blocks[pin.block_ids]
        held = self._tenant_blocks[pin.tenant]
        for b in pin.block_ids:
            _drop_one(self._block_pins, b)
            _drop_one(held, b)
        if not held:
            del self._tenant_blocks[pin.tenant]
        if self.on_remove is not None:
            self.on_remove(pin_id)
        return pin.block_ids

    def pop_expired(self, now: float) -> list[tuple[int, ...]]:
        """Removes the pins whose expiry is <= now; returns the blocks each held."""
        released = []
        heap = self._expiry
        while heap:
            expires_at, seq, pin_id = heap[0]
            pin = self._pins.get(pin_id)
            if pin is None or pin.seq != seq:
                heapq.heappop(heap)       # entry of a removed or refreshed pin
            elif expires_at <= now:
                heapq.heappop(heap)
                released.append(self._release(pin_id, self._pins.pop(pin_id)))
            else:
                break
        return released

    def infos(self) -> list[PinInfo]:
        return [pin.info(pin_id) for pin_id, pin in self._pins.items()]

    def info(self, pin_id: str) -> Optional[PinInfo]:
        pin = self._pins.get(pin_id)
        return None if pin is None else pin.info(pin_id)

    def clear(self) -> list[tuple[int, ...]]:
        released = [self._release(pin_id, self._pins.pop(pin_id)) for pin_id in list(self._pins)]
        self._expiry.clear()
        return released


def _drop_one(counts: dict[int, int], block_id: int) -> None:
    left = counts[block_id] - 1
    if left:
        counts[block_id] = left
    else:
        del counts[block_id]
