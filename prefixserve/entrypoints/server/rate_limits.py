"""Per-key token-rate limits (`tokens_per_minute` in the keys file, auth.py).

Each limited key has a bucket of tokens_per_minute tokens, refilled continuously. A request is
admitted while the bucket holds its prompt tokens (or is full, so a prompt larger than a whole
minute's tokens still runs, alone); its prompt tokens are taken at once and its output tokens
when it finishes, so the bucket may go below zero and the next request then waits for the
refill. A refused request gets 429 with Retry-After: the seconds until the bucket holds what it
asked for. Buckets live per key of the keys file, so their number is bounded.
"""
from __future__ import annotations

import math
import threading
import time
from typing import Callable, Optional

from prefixserve.entrypoints.server.auth import Principal
from prefixserve.entrypoints.server.errors import APIError


class TokenRateLimiter:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._levels: dict[str, tuple[float, float]] = {}   # key id -> (tokens, as of when)
        self._lock = threading.Lock()

    def _level(self, key_id: str, rate: int, now: float) -> float:
        level, at = self._levels.get(key_id, (float(rate), now))
        return min(float(rate), level + (now - at) * rate / 60.0)

    def admit(self, principal: Principal, tokens: int) -> None:
        """Takes a request's prompt tokens from its key's bucket, or raises the 429."""
        rate, key_id = principal.tokens_per_minute, principal.key_id
        if rate is None or key_id is None:
            return
        with self._lock:
            now = self._clock()
            level = self._level(key_id, rate, now)
            need = min(tokens, rate)
            if level < need:
                wait = math.ceil((need - level) * 60.0 / rate)
                raise APIError(429, f"this API key may spend {rate} tokens per minute; this request's "
                                    f"{tokens} prompt tokens fit in about {wait} s",
                               type="rate_limit_error", code="tokens_per_minute_exceeded",
                               headers={"Retry-After": str(max(1, wait))})
            self._levels[key_id] = (level - tokens, now)

    def spend(self, principal: Principal, tokens: int) -> None:
        """Takes a finished request's output tokens from its key's bucket."""
        rate, key_id = principal.tokens_per_minute, principal.key_id
        if rate is None or key_id is None or tokens <= 0:
            return
        with self._lock:
            now = self._clock()
            self._levels[key_id] = (self._level(key_id, rate, now) - tokens, now)

    def level(self, principal: Principal) -> Optional[float]:
        """The tokens the key's bucket holds now (None: not limited)."""
        rate, key_id = principal.tokens_per_minute, principal.key_id
        if rate is None or key_id is None:
            return None
        with self._lock:
            return self._level(key_id, rate, self._clock())
