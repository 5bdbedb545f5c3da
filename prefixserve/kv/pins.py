"""Pins: explicit holds on cached prefix blocks, with optional expiry and a cap."""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Optional

from prefixserve.errors import PinLimitError


@dataclass
class PinInfo:
    pin_id: str
    block_ids: list[int]
    num_tokens: int
    expires_at: Optional[float]   # clock() time; None = until unpinned


@dataclass
class _Pin:
    block_ids: tuple[int, ...]
    num_tokens: int
    expires_at: Optional[float]
    seq: int   # identifies the pin's current entry in the expiry heap

    def info(self, pin_id: str) -> PinInfo:
        return PinInfo(pin_id, list(self.block_ids), self.num_tokens, self.expires_at)


class PinRegistry:
    """Which pins exist and which blocks they hold. The manager turns each pin into one
    reference on each of its blocks, so a pinned block is in use and never evictable."""

    def __init__(self, max_pinned_blocks: Optional[int]) -> None:
        self.max_pinned_blocks = max_pinned_blocks
        self._pins: dict[str, _Pin] = {}
        self._by_blocks: dict[tuple[int, ...], str] = {}
        self._block_pins: dict[int, int] = {}   # block id -> number of live pins holding it
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

    def find(self, block_ids: tuple[int, ...]) -> Optional[str]:
        return self._by_blocks.get(block_ids)

    def check_cap(self, block_ids: tuple[int, ...]) -> None:
        if self.max_pinned_blocks is None:
            return
        new = sum(1 for b in block_ids if b not in self._block_pins)
        total = len(self._block_pins) + new
        if total > self.max_pinned_blocks:
            raise PinLimitError(
                f"pinning {len(block_ids)} blocks ({new} not yet pinned) would pin {total} blocks; "
                f"max_pinned_blocks is {self.max_pinned_blocks}. Unpin something first.")

    def add(self, block_ids: tuple[int, ...], num_tokens: int,
            expires_at: Optional[float]) -> PinInfo:
        self._seq += 1
        pin_id = f"pin-{self._seq}"
        pin = _Pin(block_ids, num_tokens, expires_at, self._seq)
        self._pins[pin_id] = pin
        self._by_blocks[block_ids] = pin_id
        for b in block_ids:
            self._block_pins[b] = self._block_pins.get(b, 0) + 1
        if expires_at is not None:
            heapq.heappush(self._expiry, (expires_at, pin.seq, pin_id))
        return pin.info(pin_id)

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
            heapq.heappush(self._expiry, (expires_at, pin.seq, pin_id))
        return pin.info(pin_id)

    def remove(self, pin_id: str) -> Optional[tuple[int, ...]]:
        """Forgets a pin; returns the blocks it held (None if no such pin)."""
        pin = self._pins.pop(pin_id, None)
        if pin is None:
            return None
        del self._by_blocks[pin.block_ids]
        for b in pin.block_ids:
            left = self._block_pins[b] - 1
            if left:
                self._block_pins[b] = left
            else:
                del self._block_pins[b]
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
                released.append(self.remove(pin_id))
            else:
                break
        return released

    def infos(self) -> list[PinInfo]:
        return [pin.info(pin_id) for pin_id, pin in self._pins.items()]

    def clear(self) -> list[tuple[int, ...]]:
        released = [self.remove(pin_id) for pin_id in list(self._pins)]
        self._expiry.clear()
        return released
