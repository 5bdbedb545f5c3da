"""Configuration of the KV block bookkeeping."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Union

HASH_ALGOS = ("xxh3_64", "xxh3_128", "sha256")
EVICTION_POLICIES = ("lru", "lfu", "priority")


def check_weights(weights: Union[Mapping[str, float], Iterable[tuple[str, float]]]
                  ) -> tuple[tuple[str, float], ...]:
    """(name, weight) pairs as a tuple; every weight a positive finite number, names unique."""
    pairs = tuple(weights.items()) if isinstance(weights, Mapping) else tuple(weights)
    names = set()
    for pair in pairs:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise ValueError(f"tenant_weights holds (tenant, weight) pairs, got {pair!r}")
        name, weight = pair
        if not isinstance(name, str) or not name:
            raise ValueError(f"a tenant name is a non-empty string, got {name!r}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < float("inf"):
            raise ValueError(f"tenant {name!r}: weight must be a positive number, got {weight!r}")
        if name in names:
            raise ValueError(f"tenant {name!r} is weighted twice")
        names.add(name)
    return pairs


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
    # (tenant, weight) pairs: with two or more and tenant_cache_shares, each tenant's cached
    # blocks keep a floor of its weighted share of the pool (kv/tenant_shares.py).
    tenant_weights: tuple = ()
    tenant_cache_shares: bool = True

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
        object.__setattr__(self, "tenant_weights", check_weights(self.tenant_weights))
        if not isinstance(self.tenant_cache_shares, bool):
            raise ValueError(f"tenant_cache_shares must be a bool, got {self.tenant_cache_shares!r}")
