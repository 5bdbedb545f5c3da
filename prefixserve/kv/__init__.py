"""KV block bookkeeping: block hashing, the block pool, eviction and the per-request manager.

Pure Python (stdlib + xxhash); no torch, so every cache decision is testable without a model.
"""
from prefixserve.kv.allocation import Allocation, PrefixHit
from prefixserve.kv.block_pool import BlockPool
from prefixserve.kv.config import EVICTION_POLICIES, HASH_ALGOS, KVCacheConfig, check_weights
from prefixserve.kv.eviction import (EvictionPolicy, LFUPolicy, LRUPolicy, PriorityPolicy,
                                     make_policy)
from prefixserve.kv.hashing import (SALT_TAG, BlockHash, BlockHasher, encode_extra_keys,
                                    request_extra_keys, token_bytes)
from prefixserve.kv.manager import KVCacheManager
from prefixserve.kv.pins import PinInfo, PinLimitError
from prefixserve.kv.stats import KVCacheStats
from prefixserve.kv.tenant_shares import TenantShares

__all__ = [
    "Allocation", "BlockHash", "BlockHasher", "BlockPool", "EVICTION_POLICIES",
    "EvictionPolicy", "HASH_ALGOS", "KVCacheConfig", "KVCacheManager", "KVCacheStats",
    "LFUPolicy", "LRUPolicy", "PinInfo", "PinLimitError", "PrefixHit", "PriorityPolicy",
    "SALT_TAG", "TenantShares", "check_weights", "encode_extra_keys", "make_policy",
    "request_extra_keys", "token_bytes",
]
