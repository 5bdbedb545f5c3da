"""Prompts that share a prefix, and the brute-force count of the tokens prefix caching must
serve from the cache for them: shared by tests/engine/test_engine_prefix_caching.py and
tests/platforms/test_cuda_device.py."""
from __future__ import annotations

import random

BS = 16


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 4000) for _ in range(n)]


def shared_prefix_prompts(prefix_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = tokens(rng, prefix_len)
    return [prefix + tokens(rng, rng.randrange(1, 9)) for _ in range(3)]


def expected_cached(previous: list[list[int]], prompt: list[int]) -> int:
    """Brute force: the longest block-aligned prefix shared with any earlier full sequence,
    never including the prompt's last token."""
    best = 0
    for seq in previous:
        lcp = 0
        while lcp < min(len(seq), len(prompt)) and seq[lcp] == prompt[lcp]:
            lcp += 1
        best = max(best, lcp)
    return min(best, len(prompt) - 1) // BS * BS
