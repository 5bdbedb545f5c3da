"""Counters of the KV cache, in tokens where they measure the prefix cache."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KVCacheCounters:
    """Running totals kept by the manager."""
    queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    recomputed_queries: int = 0
    recomputed_query_tokens: int = 0
    recomputed_hit_tokens: int = 0
    cow_copies: int = 0


@dataclass
class KVCacheStats:
    num_blocks: int
    num_free_blocks: int          # free and uncached
    num_cached_free_blocks: int   # free, hash kept, evictable
    num_used_blocks: int          # ref >= 1 (request tables and pins)
    num_pinned_blocks: int        # distinct blocks held by live pins (a subset of used)
    num_cached_blocks: int        # blocks in the hash index (cached free + cached in use)
    num_requests: int
    # Prefix-cache queries of new requests (one per admitted request, counted when its
    # allocation succeeds), in tokens; preempted-and-resumed requests are counted apart.
    queries: int
    query_tokens: int
    hit_tokens: int
    recomputed_queries: int
    recomputed_query_tokens: int
    recomputed_hit_tokens: int
    evictions: int                # cached blocks whose hash was dropped to reuse the block
    cow_copies: int
    # per named tenant: its cached blocks evicted (charged to the tenant that wrote them)
    evictions_by_tenant: dict = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks
