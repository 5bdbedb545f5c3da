"""Settings of the OpenAI-compatible HTTP server, checked at construction."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from prefixserve.entrypoints.server.auth import KeyTable
from prefixserve.entrypoints.server.media import MediaConfig


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # The name clients pass as `model`; None: the engine's model string.
    served_model_name: Optional[str] = None
    # Sequences (each request its n) accepted and not finished; beyond this the server answers
    # 429. Any of them may have to wait (a preempted one too), so the waiting queue never holds
    # more. None: unbounded (only sensible behind something else that bounds load).
    max_waiting: Optional[int] = 1024
    # Seconds a client is told to wait (Retry-After) when the waiting queue is full (429) or the
    # server cannot serve the request now (503: no room, the engine stopped, the response store down).
    retry_after_s: int = 1
    # Completions' max_tokens when the request gives none (OpenAI's default); chat has no default
    # and may generate up to max_model_len.
    default_completion_max_tokens: int = 16
    # Multiplies every cache TTL ("5m", "1h", cached contents' ttl); tests use a small value so
    # that pins expire within seconds.
    cache_ttl_scale: float = 1.0
    # Requests the live miss explainer remembers (each keeps its prompt's token ids), for
    # `diagnose` and `diagnose_against`; the oldest are forgotten first.
    diagnose_max_requests: int = 1000
    # API keys -> tenants (None: no authentication, one anonymous tenant; see auth.py).
    keys: Optional[KeyTable] = None
    # Bounds applied before anything else reads a request.
    max_body_bytes: int = 16 * 2**20
    max_messages: int = 2048
    # Bodies larger than this are parsed and validated in the render process, off the event loop
    # (below it, a trip to the child costs more than the parse).
    offload_body_bytes: int = 64 * 2**10
    # Longest a cached content or cache_control pin may live, before cache_ttl_scale.
    max_cache_ttl_s: float = 7 * 86400.0
    # A chat template sent by the client runs only when the operator trusts clients with it.
    trust_request_chat_template: bool = False
    # Unknown request fields are a 400 naming them, as on OpenAI's API; with this they are
    # accepted, dropped and logged once per field name, for clients that send extras.
    allow_unknown_fields: bool = False
    # Longest one rendering may take in the render process before it is killed (a 400).
    render_timeout_s: float = 10.0
    # JSONL log of every finished generation request, in the format `prefixserve lint` reads
    # (request_log.py); None: no log. It rotates to PATH.1 before passing request_log_max_bytes.
    request_log: Optional[str] = None
    request_log_max_bytes: int = 64 * 2**20
    # Where /v1/responses keeps stored responses (response_store.py): mem:// (None), file:///dir or
    # redis://host:port/db; each tenant holds at most so many responses and bytes, each response
    # for ttl seconds.
    response_store: Optional[str] = None
    response_store_ttl_s: float = 30 * 86400.0
    response_store_max_responses: int = 10_000
    response_store_max_bytes: int = 256 * 2**20
    # where image parts may come from and how large they may be (media.py)
    media: MediaConfig = MediaConfig()

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must be a non-empty string, got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an integer in [0, 65535], got {self.port!r}")
        if self.served_model_name is not None and (not isinstance(self.served_model_name, str)
                                                   or not self.served_model_name):
            raise ValueError(f"served_model_name must be a non-empty string or None, "
                             f"got {self.served_model_name!r}")
        if self.max_waiting is not None:
            _positive("max_waiting", self.max_waiting)
        _positive("retry_after_s", self.retry_after_s)
        _positive("default_completion_max_tokens", self.default_completion_max_tokens)
        _positive("diagnose_max_requests", self.diagnose_max_requests)
        _positive("max_body_bytes", self.max_body_bytes)
        _positive("max_messages", self.max_messages)
        _positive("offload_body_bytes", self.offload_body_bytes)
        _positive("request_log_max_bytes", self.request_log_max_bytes)
        _positive("response_store_max_responses", self.response_store_max_responses)
        _positive("response_store_max_bytes", self.response_store_max_bytes)
        if self.request_log is not None and (not isinstance(self.request_log, str) or not self.request_log):
            raise ValueError(f"request_log must be a non-empty path or None, got {self.request_log!r}")
        for name in ("max_cache_ttl_s", "render_timeout_s", "response_store_ttl_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        if self.keys is not None and not isinstance(self.keys, KeyTable):
            raise ValueError(f"keys must be a KeyTable or None, got {type(self.keys).__name__}")
        if isinstance(self.cache_ttl_scale, bool) or not isinstance(self.cache_ttl_scale, (int, float)) \
                or not self.cache_ttl_scale > 0:
            raise ValueError(f"cache_ttl_scale must be a positive number, got {self.cache_ttl_scale!r}")


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
