"""What the engine hands back: vLLM-shaped request and completion outputs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from prefixserve.engine.cached_contents import CachedContent
    from prefixserve.model.vision_config import VisionConfig


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    cumulative_logprob: Optional[float] = None
    # Per generated token: (sampled logprob, [(token id, logprob), ...] alternatives).
    logprobs: Optional[list[tuple[float, list[tuple[int, float]]]]] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class CachePin:
    """Asks the engine to pin the first num_tokens of a prompt once it is computed."""
    num_tokens: int
    ttl_s: Optional[float] = None  # None: until unpinned
    # Registered under this pin in the same engine call that places it (creation is atomic).
    content: Optional[CachedContent] = None
    # Whose share of the pinned blocks a new pin counts against (max_pinned_fraction_per_tenant).
    tenant: Optional[str] = None
    # Token-exact: the prefix is kept to the token, its partial last block cached too (an
    # explicit prompt_cache_breakpoint); otherwise only its full blocks (cache_control).
    exact: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.num_tokens, bool) or not isinstance(self.num_tokens, int) or self.num_tokens < 1:
            raise ValueError(f"num_tokens must be a positive integer, got {self.num_tokens!r}")
        if self.ttl_s is not None and not self.ttl_s > 0:
            raise ValueError(f"ttl_s must be positive or None, got {self.ttl_s!r}")


@dataclass
class PinResult:
    requested_tokens: int
    # Tokens actually pinned: block-aligned, or to the token for an exact pin.
    pinned_tokens: int
    expires_at: Optional[float]
    error: Optional[str] = None  # set when a cap refused it (or a content's name was taken)
    pin_id: Optional[str] = None
    error_code: Optional[str] = None  # the refusal's code: pin_limit, tenant_pin_limit, name_taken, ...


@dataclass(frozen=True)
class PinInfo:
    """A live pin as callers of the engine see it."""
    pin_id: Optional[str]  # None: nothing was cached, so nothing was pinned
    num_tokens: int        # block-aligned tokens held
    expires_at: Optional[float]  # engine clock time; None: until unpinned


@dataclass(frozen=True)
class EngineInfo:
    """The read-only facts about a running engine that entry points need."""
    model: str
    model_identity: str
    dtype: str
    device: str
    block_size: int
    max_model_len: int
    num_kv_blocks: int
    enable_prefix_caching: bool
    # native CPU kernel -> {"active": bool, "reason": why not, ...} (platforms/cpu/native/report.py)
    kernels: dict = field(default_factory=dict)
    # why this dtype: "asked for explicitly", or what dtype="auto" found (platforms/cpu/dtype_choice.py)
    dtype_reason: str = ""
    # the key scope of its KV stores ("" without stores): engines with equal scopes read each
    # other's stored blocks (kv/stores/scope.py)
    kv_store_scope: str = ""
    # how the KV pool holds K/V: "rows" or "panels" (model/kv_layout.py)
    kv_layout: str = "rows"
    # whether prompts may carry images (a vision-language model)
    takes_images: bool = False
    # its image settings (model/vision_config.py), so that a front over replicas hashes and places a
    # prompt's images as the engines will (replicas/front.py); None for a text model
    vision: Optional[VisionConfig] = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None

    @property
    def time_to_first_token(self) -> Optional[float]:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> Optional[float]:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    # Prompt tokens served from the prefix cache instead of being computed.
    num_cached_tokens: int
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    cache_salt: Optional[str] = None
    error: Optional[str] = None
    pins: list[PinResult] = field(default_factory=list)
    # (content hash, first token, number of tokens) of each image in prompt_token_ids
    image_spans: tuple = ()


@dataclass(frozen=True)
class TenantStats:
    """One named tenant's part of the engine: its requests, what it was served, what it lost."""
    tenant: str
    num_waiting: int
    num_running: int
    tokens_served: int         # prompt tokens computed and output tokens generated for it
    prompt_tokens: int         # of its admitted requests
    cached_prompt_tokens: int  # of those, found in the prefix cache
    evictions: int             # its cached blocks evicted (for anyone's miss)


@dataclass
class EngineStats:
    prompt_tokens: int
    cached_prompt_tokens: int
    computed_prompt_tokens: int
    computed_tokens: int
    generated_tokens: int
    requests_finished: int
    num_running: int
    num_waiting: int
    preemptions: int
    steps: int
    blocks_total: int
    blocks_free: int
    blocks_cached: int
    blocks_in_use: int
    blocks_pinned: int
    evictions: int
    cow_copies: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    kv_cache_bytes: int
    # the model's parameters and buffers, each storage once (tied embeddings count once)
    weights_bytes: int
    dtype: str = ""  # weights, activations and KV pool ("auto" resolved)
    # native CPU kernel name -> active (the reasons are in EngineInfo.kernels)
    kernels_active: dict = field(default_factory=dict)
    # sequences the unfinished requests hold or will hold (each request its n): the most
    # that could ever wait at once, preempted ones included
    num_seats: int = 0
    # one KVStoreStats (kv/stores/stats.py) per configured KV store, fastest first
    kv_stores: tuple = ()
    # a vision-language model's: images the vision tower encoded, images served from the encoder cache
    encoder_runs: int = 0
    encoder_cache_hits: int = 0
    # images the engine decoded, resized and hashed itself; not those handed over prepared (the
    # server's render process, the replicas' front)
    images_prepared: int = 0
    # num_seats of each named tenant's requests, and one TenantStats per tenant the engine's
    # tenant_weights name (none without them)
    seats_by_tenant: dict = field(default_factory=dict)
    tenants: tuple = ()

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
