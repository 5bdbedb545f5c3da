"""Replays a request log through the engine's own KV bookkeeping (prefixserve.kv).

Lifetime model: requests are served one at a time in log order. Each request looks up its
longest cached prefix (find_cached_prefix), takes those blocks and allocates the rest of its
prompt (allocate_slots, which registers every full block exactly as the engine's scheduler
does), then, when the log tells what it generated, allocates its generated tokens too (all but
the last, whose K/V the engine never computes) and finally frees everything (free), leaving
the blocks cached for later requests until the pool needs them. A request's lifetime ends
before the next one starts: concurrency is not modelled, so the pool never holds more than one
request's live blocks, and a replay's hits equal what the engine reports for the same
requests run one after another with the same pool size. Generated tokens are the logged
reply's tokens (or placeholders when only their count is logged): they occupy and may evict
blocks like decode does, and their full blocks are registered like the engine registers them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from prefixserve.kv import KVCacheConfig, KVCacheManager


# Lookups hold no blocks, so every probe can use one id no served request has.
_PROBE_ID = "\0probe"


@dataclass(frozen=True)
class ReplayRequest:
    request_id: str
    token_ids: Sequence[int]
    cache_salt: Optional[str] = None
    output_token_ids: Sequence[int] = ()

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError(f"request {self.request_id!r}: token_ids is empty")


@dataclass(frozen=True)
class ReplayConfig:
    num_blocks: int
    block_size: int = 16
    eviction_policy: str = "lru"
    hash_algo: str = "xxh3_64"

    def kv_config(self) -> KVCacheConfig:
        # KVCacheConfig validates every field and names the bad one.
        return KVCacheConfig(num_blocks=self.num_blocks, block_size=self.block_size,
                             eviction_policy=self.eviction_policy, hash_algo=self.hash_algo)


@dataclass
class ReplayResult:
    config: ReplayConfig
    num_requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    output_tokens: int = 0
    evictions: int = 0
    hits: list[int] = field(default_factory=list)        # per request, in replay order
    # request id -> hit of each probe looked up just before that request (see replay())
    probe_hits: dict[str, list[int]] = field(default_factory=dict)
    too_large: list[str] = field(default_factory=list)   # requests needing more blocks than the pool

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def blocks_needed(request: ReplayRequest, block_size: int) -> int:
    computed = len(request.token_ids) + max(0, len(request.output_token_ids) - 1)
    return -(-computed // block_size)


def unbounded_num_blocks(requests: Sequence[ReplayRequest], block_size: int) -> int:
    """A pool size that never evicts: room for every block of every request."""
    return max(1, sum(blocks_needed(r, block_size) for r in requests))


def replay(requests: Sequence[ReplayRequest], config: ReplayConfig,
           probes: Optional[Mapping[str, Sequence[Sequence[int]]]] = None) -> ReplayResult:
    """probes[request_id]: other prompts (same salt) looked up, without being served, in the
    cache exactly as the requests before that one left it: what the engine would have reused
    had that request been sent as each of them instead."""
    kv = KVCacheManager(config.kv_config())
    result = ReplayResult(config=config)
    probes = probes or {}
    for req in requests:
        prompt = list(req.token_ids)
        outputs = list(req.output_token_ids)
        result.num_requests += 1
        if req.request_id in probes:
            result.probe_hits[req.request_id] = [
                kv.find_cached_prefix(_PROBE_ID, list(ids), cache_salt=req.cache_salt).num_tokens
                for ids in probes[req.request_id]]
        if blocks_needed(req, config.block_size) > config.num_blocks:
            # The engine rejects such a request outright; it neither hits nor fills the cache.
            result.too_large.append(req.request_id)
            result.hits.append(0)
            continue
        hit = kv.find_cached_prefix(req.request_id, prompt, cache_salt=req.cache_salt)
        tokens = prompt + outputs
        kv.allocate_slots(req.request_id, tokens, hit.num_tokens, len(prompt) - hit.num_tokens,
                          hit=hit, cache_salt=req.cache_salt)
        if len(outputs) > 1:
            kv.allocate_slots(req.request_id, tokens, len(prompt), len(outputs) - 1,
                              cache_salt=req.cache_salt)
        kv.free(req.request_id)
        result.prompt_tokens += len(prompt)
        result.hit_tokens += hit.num_tokens
        result.output_tokens += len(outputs)
        result.hits.append(hit.num_tokens)
    result.evictions = kv.stats().evictions
    return result


def replay_unbounded(requests: Sequence[ReplayRequest], block_size: int = 16,
                     probes: Optional[Mapping[str, Sequence[Sequence[int]]]] = None) -> ReplayResult:
    """Hits of a cache big enough never to evict."""
    return replay(requests, ReplayConfig(num_blocks=unbounded_num_blocks(requests, block_size),
                                         block_size=block_size), probes)
