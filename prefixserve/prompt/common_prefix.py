"""The longest common prefix of two strings or two token sequences: where two prompts part.

Breakpoints, spans, divergences and lint rules all ask this question; they share one answer.
"""
from __future__ import annotations

from typing import Any, Sequence


def common_prefix_len(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How many leading items (characters or tokens) a and b share."""
    if not (type(a) is type(b) and isinstance(a, (str, list, tuple))):
        # Slices of different sequence types never compare equal ([1] != (1,)).
        a, b = list(a), list(b)
    lo, hi = 0, min(len(a), len(b))
    # Binary search on slice equality: O(log n) comparisons that each run in C, about 2n items
    # compared in all. A Python loop over a long prompt costs milliseconds per comparison.
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
