"""Best-of-N wall-clock timing, shared by every benchmark (imports nothing heavy)."""
from __future__ import annotations

import time
from typing import Callable


def best_seconds(fn: Callable[[], object], repeat: int, *, warmup: bool = True) -> float:
    """The fastest of `repeat` calls: on a shared machine the minimum is the least disturbed run.

    warmup makes one untimed call first, so first-touch page faults and kernel selection are not
    counted as the machine's limit.
    """
    if warmup:
        fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
