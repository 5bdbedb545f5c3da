"""A brute-force oracle of the replica routing tests (tests/replicas/test_replicas_routing.py and
test_replicas_store_routing.py): the prefix hits a given assignment of requests to replicas
must get."""
from __future__ import annotations


def oracle_hits(requests, assignment, block_size):
    """Hit tokens with unbounded pools: the longest block prefix (same salt) seen before on the
    same replica, never the block of the last prompt token."""
    seen = {}
    total = 0
    for req, replica in zip(requests, assignment):
        tokens = list(req.token_ids)
        usable = (len(tokens) - 1) // block_size
        held = seen.setdefault(replica, set())
        n = 0
        while n < usable and (req.cache_salt, tuple(tokens[:(n + 1) * block_size])) in held:
            n += 1
        total += n * block_size
        for k in range(1, len(tokens) // block_size + 1):
            held.add((req.cache_salt, tuple(tokens[:k * block_size])))
    return total
