"""Everything that shapes an engine, checked once at construction."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from prefixserve.kv.config import EVICTION_POLICIES, HASH_ALGOS, check_weights
from prefixserve.kv.stores.url import parse_size as parse_size  # re-exported for entry points
from prefixserve.kv.stores.url import parse_store_url
from prefixserve.scheduler.config import SCHEDULING_POLICIES

DEFAULT_CPU_KV_CACHE_MEMORY = 4 * 1024**3
DTYPES = ("auto", "float32", "bfloat16", "float16")
# Device types an engine can be asked for, in torch.device's spelling ("cuda", "cuda:1"). Only the
# form is checked here (no torch import); the engine checks at start that the device exists.
DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")
_DEVICE = re.compile(r"(?P<type>[a-z]+)(:(0|[1-9][0-9]*))?")
KV_STORE_WRITES = ("back", "through")
_BACKEND_NAME = re.compile(r"[a-z0-9][a-z0-9_\-]*")
KV_LAYOUTS = ("auto", "rows", "panels")
# Fields the engine hands to kv and the scheduler, each checked against the values they accept,
# so a bad one fails here rather than once the model is loaded (and entry points, which may not
# import kv or the scheduler, take their choices from here, and parse_size: a byte count with
# the units the store URLs take, so every size on the command line reads the same way).
_CHOICES = {"hash_algo": HASH_ALGOS, "eviction_policy": EVICTION_POLICIES,
            "scheduling_policy": SCHEDULING_POLICIES}


@dataclass(frozen=True)
class EngineConfig:
    model: str = "random:qwen3-tiny"
    # auto: bfloat16 on a CPU with AMX, or with avx512_bf16 where a bfloat16 matmul is measured
    # clearly faster; float32 on other CPUs (platforms/cpu/dtype_choice.py)
    dtype: str = "auto"
    device: str = "cpu"
    # A registered attention backend's name, or "auto": the fastest one for the device and dtype.
    attention_backend: str = "auto"
    seed: int = 0
    block_size: int = 16
    # How the KV pool holds K/V (model/kv_layout.py). auto: panels where the native attention tiles
    # read them (a bfloat16 pool on a CPU with avx512_bf16, a float32 one on AVX-512; blocks and head
    # dims of whole 16-element panels), rows elsewhere.
    kv_layout: str = "auto"
    # No decode program, every step through the modules: on CUDA no decode graphs (platforms/cuda/graphs.py),
    # on the CPU no native decode loop (platforms/cpu/decode_program.py).
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    hash_algo: str = "xxh3_64"
    eviction_policy: str = "lru"
    # KV pool size: an explicit block count wins over a memory budget in bytes.
    kv_cache_memory: Optional[int] = None
    num_kv_blocks: Optional[int] = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: Optional[int] = None  # None: the model's limit, capped at 32768
    scheduling_policy: str = "fcfs"
    max_waiting: Optional[int] = None
    # (tenant, weight) pairs (a dict is taken and kept as pairs): each named tenant's share of
    # max_waiting, of each step and of the running slots, and of the KV pool's cached blocks.
    # A tenant not named weighs 1 and has no share of its own (docs/tenants.md).
    tenant_weights: tuple = ()
    # Share max_waiting and each step across tenants by weight and weighted served-token counters
    # (off: one queue for all, ordered as fcfs or priority says); keep each named tenant's cached
    # blocks above its floor.
    fair_scheduling: bool = True
    tenant_cache_shares: bool = True
    # Share of the KV pool that explicit pins may hold, so pins cannot starve live requests.
    max_pinned_fraction: float = 0.5
    # Share of the KV pool one tenant's pins may hold (CachePin.tenant), so one tenant cannot
    # take the whole pinned share and refuse every other tenant's pins; None: no share of its own.
    max_pinned_fraction_per_tenant: Optional[float] = None
    # Named cached contents one tenant may hold (identical contents share a pin, so the pin cap
    # alone does not bound them); None: no limit.
    max_cached_contents_per_tenant: Optional[int] = 1024
    # KV stores beneath the pool, fastest first (docs/kv-stores.md): mem://?size=8GiB,
    # file:///dir?size=100GiB, redis://host:6379/0. A list is taken and kept as a tuple.
    kv_stores: tuple = ()
    # "back": blocks are written when the pool evicts them; "through": once computed.
    kv_store_write: str = "back"
    # Bytes of blocks waiting for the background writer; beyond it blocks are dropped.
    kv_store_queue_bytes: int = 256 * 1024**2
    # Most items of each kind one prompt may carry ({"image": 4}); a kind not named is not limited.
    limit_mm_per_prompt: dict = field(default_factory=dict)
    # Bytes of vision-tower outputs kept by image content hash (worker/encoder_cache.py).
    encoder_cache_bytes: int = 256 * 1024**2

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty string, got {self.model!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        device = _DEVICE.fullmatch(self.device) if isinstance(self.device, str) else None
        if device is None or device["type"] not in DEVICE_TYPES:
            raise ValueError(f"device must be one of {DEVICE_TYPES}, optionally with an index "
                             f"(\"cuda:1\"), got {self.device!r}")
        if not isinstance(self.attention_backend, str) or not _BACKEND_NAME.fullmatch(self.attention_backend):
            raise ValueError(f"attention_backend must be 'auto' or a backend name, got {self.attention_backend!r}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {self.kv_layout!r}")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            _positive(name, getattr(self, name))
        for name in ("kv_cache_memory", "num_kv_blocks", "max_model_len", "max_waiting"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if not _fraction(self.max_pinned_fraction):
            raise ValueError(f"max_pinned_fraction must be in [0, 1], got {self.max_pinned_fraction!r}")
        if self.max_pinned_fraction_per_tenant is not None and not _fraction(self.max_pinned_fraction_per_tenant):
            raise ValueError(f"max_pinned_fraction_per_tenant must be None or in [0, 1], "
                             f"got {self.max_pinned_fraction_per_tenant!r}")
        if self.max_cached_contents_per_tenant is not None:
            _positive("max_cached_contents_per_tenant", self.max_cached_contents_per_tenant)
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        _check_kv_stores(self)
        limits = self.limit_mm_per_prompt
        if not isinstance(limits, dict) or any(k != "image" or isinstance(v, bool) or not isinstance(v, int)
                                               or v < 0 for k, v in limits.items()):
            raise ValueError(f"limit_mm_per_prompt must map 'image' to an int >= 0, got {limits!r}")
        if isinstance(self.encoder_cache_bytes, bool) or not isinstance(self.encoder_cache_bytes, int) \
                or self.encoder_cache_bytes < 0:
            raise ValueError(f"encoder_cache_bytes must be an int >= 0, got {self.encoder_cache_bytes!r}")
        object.__setattr__(self, "tenant_weights", check_weights(self.tenant_weights))
        for name in ("fair_scheduling", "tenant_cache_shares"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")


def _check_kv_stores(config: EngineConfig) -> None:
    stores = config.kv_stores
    if isinstance(stores, str) or not isinstance(stores, (list, tuple)):
        raise ValueError(f"kv_stores must be a list of store URLs, got {stores!r}")
    object.__setattr__(config, "kv_stores", tuple(stores))
    for url in config.kv_stores:
        parse_store_url(url)
    if config.kv_store_write not in KV_STORE_WRITES:
        raise ValueError(f"kv_store_write must be one of {KV_STORE_WRITES}, got {config.kv_store_write!r}")
    _positive("kv_store_queue_bytes", config.kv_store_queue_bytes)


def _fraction(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 <= value <= 1


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
