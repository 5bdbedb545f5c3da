"""Configuration of the KV block bookkeeping."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

HASH_ALGOS = ("xxh3_64", "xxh3_128", "sha256")
EVICTION_POLICIES = ("lru", "lfu", "priority")


@dataclass(frozen=True)
class KVCacheConfig:
    num_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = True
    hash_algo: str = "xxh3_64"
    eviction_policy: str = "lru"
    # Seeds the hash chain: the same string gives the same block hashes in every process.
    model_identity: str = ""
    # Cap on distinct pinned blocks; None leaves pins limited only by the pool.
    max_pinned_blocks: Optional[int] = None
    # Cap on the distinct blocks one tenant's pins hold (kv/pins.py); None: only the cap above.
    max_pinned_blocks_per_tenant: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        if self.hash_algo not in HASH_ALGOS:
            raise ValueError(f"hash_algo must be one of {HASH_ALGOS}, got {self.hash_algo!r}")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"eviction_policy must be one of {EVICTION_POLICIES}, got {self.eviction_policy!r}")
        if not isinstance(self.model_identity, str):
            raise ValueError(f"model_identity must be a str, got {self.model_identity!r}")
        for name in ("max_pinned_blocks", "max_pinned_blocks_per_tenant"):
            cap = getattr(self, name)
            if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
                raise ValueError(f"{name} must be None or an int >= 0, got {cap!r}")
