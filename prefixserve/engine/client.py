"""Every call a client makes on an engine, declared once.

The HTTP server (entrypoints/server) and the tools built on it reach an engine through these
calls only, so adding one touches four classes; tests/engine/test_engine_client_protocol.py fails
until each serves it in its role:

- A front (asynchronous): `AsyncLLM` (one engine, run by a background thread) and
  `replicas/front.ReplicatedLLM` (engine replicas behind Ray Serve) are `EngineClient`s: every
  call with the parameters written here, a coroutine where it is one here. A front that cannot
  serve a call still defines it and raises the error a client gets for it (ReplicatedLLM:
  pins by id and the KV event feed each live in one engine).
- The engine (synchronous): `LLMEngine` serves the calls past a front, all but FRONT_ONLY, on
  the engine thread, under the same names and parameters, as plain methods. It may take more
  keyword-only parameters, each with a default, that only a front passes (add_request's
  arrival_time and grammar), and may default one the front requires.
- A replica (remote): `replicas/deployment.EngineReplica` serves, as Ray Serve coroutines, each
  call ReplicatedLLM sends through its handle, with this file's parameters, except that a
  prompt arrives as `token_ids` (the front tokenizes once, and the router hashes those ids)
  and a call may take `target_replica` last, with a default (the router sends it to that one).
"""
from __future__ import annotations

from typing import (TYPE_CHECKING, AsyncGenerator, AsyncIterator, Callable, Optional, Protocol, Sequence,
                    runtime_checkable)

from prefixserve.engine.cached_contents import CachedContent
from prefixserve.engine.intake import PromptInput
from prefixserve.engine.outputs import CachePin, EngineInfo, EngineStats, PinInfo, RequestOutput
from prefixserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from prefixserve.kv.events import KVEventBatch
    from prefixserve.tokenizer import Tokenizer

# A front's own calls: starting and stopping the loop that drives the engine, streaming, and
# aborting one request from any thread (the engine's abort_request, on its thread, takes several).
FRONT_ONLY = frozenset({"start", "shutdown", "is_running", "dead_reason", "generate", "abort"})


@runtime_checkable
class EngineClient(Protocol):
    # ------------------------------------------------------------- what it serves
    @property
    def info(self) -> EngineInfo:
        """What the engine serves and how (model, dtype, device, block size, limits); immutable."""

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (the server renders and counts with it)."""

    @property
    def max_model_len(self) -> int: ...

    def now(self) -> float:
        """The engine's clock, in which pin expiries and request metrics are given."""

    def stats(self) -> EngineStats:
        """The engine's counters as of its latest step (a front never blocks on the engine)."""

    # ------------------------------------------------------------- lifecycle
    @property
    def is_running(self) -> bool: ...

    @property
    def dead_reason(self) -> Optional[str]:
        """Why the engine stopped serving; None while it serves."""

    def start(self) -> None:
        """Starts serving (idempotent)."""

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops serving; requests still in flight are failed."""

    # ------------------------------------------------------------- requests
    async def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams, *,
                          cache_salt: Optional[str] = None, priority: int = 0,
                          cache_pins: Sequence[CachePin] = (),
                          cache_write_limit: Optional[int] = None,
                          routing_key: Optional[str] = None,
                          tenant: Optional[str] = None) -> AsyncIterator[RequestOutput]:
        """Queues a request; returns its stream of (cumulative) outputs once the engine accepted
        it. cache_pins: prefixes to pin once the prompt is computed; cache_write_limit: how many
        leading prompt tokens may enter the cache (None: all); routing_key: the replica router's
        first key (prompt_cache_key, namespaced); tenant: whose request it is (a name the
        engine's tenant_weights may weigh; None: the anonymous tenant), for admission shares,
        fair scheduling and cache floors. Raises QueueFullError,
        InvalidRequestError (nothing queued) or EngineDeadError."""

    def generate(self, request_id: str, prompt: PromptInput, params: SamplingParams, *,
                 cache_salt: Optional[str] = None, priority: int = 0,
                 cache_pins: Sequence[CachePin] = (),
                 cache_write_limit: Optional[int] = None,
                 routing_key: Optional[str] = None,
                 tenant: Optional[str] = None) -> AsyncIterator[RequestOutput]:
        """add_request + iterate; the request is aborted if the iteration stops early."""

    def abort(self, request_id: str) -> None:
        """Aborts a request; unknown or finished ids are a no-op. Never blocks."""

    # ------------------------------------------------------------- the cache
    async def reset_prefix_cache(self) -> int:
        """Drops every pin, every cached content and every cached hash; returns the hashes dropped."""

    async def pin_prefix(self, token_ids: Sequence[int], *, cache_salt: Optional[str] = None,
                         num_tokens: Optional[int] = None, ttl_s: Optional[float] = None,
                         shorten: bool = False, tenant: Optional[str] = None) -> PinInfo:
        """Pins the cached full blocks of the prompt's first num_tokens tokens for ttl_s seconds
        (engine/cache_control.py)."""

    async def unpin(self, pin_id: str) -> bool: ...

    async def list_pins(self) -> list[PinInfo]: ...

    async def cached_contents(self, owner: Optional[str] = None) -> list[tuple[CachedContent, PinInfo]]: ...

    async def find_cached_content(self, key: str, owner: Optional[str] = None,
                                  param: str = "cached_content") -> tuple[CachedContent, PinInfo]: ...

    async def cached_content_name_taken(self, name: str, owner: Optional[str] = None) -> bool: ...

    async def repin_cached_content(self, key: str, ttl_s: float, owner: Optional[str] = None,
                                   param: str = "key") -> tuple[CachedContent, PinInfo]: ...

    async def delete_cached_content(self, key: str, owner: Optional[str] = None,
                                    param: str = "key") -> CachedContent: ...

    # ------------------------------------------------------------- what the pool holds
    async def kv_snapshot(self) -> list[bytes]:
        """Every block hash the pool holds, and (re)starts the KV event log from there."""

    async def kv_events(self) -> KVEventBatch:
        """What the pool stored, removed and pinned since the last call (engine/kv_event_feed.py)."""


async def until_finished(stream: AsyncIterator[RequestOutput],
                         abort: Callable[[], None]) -> AsyncGenerator[RequestOutput, None]:
    """A request's outputs as its stream gives them; `abort` runs when the consumer stops before the
    last one (a break, a cancelled task, an error), so the request's blocks are freed at once. A
    front's `generate` iterates it under contextlib.aclosing, which closes it when `generate` is closed."""
    finished = False
    try:
        async for output in stream:
            finished = output.finished
            yield output
    finally:
        if not finished:
            abort()
