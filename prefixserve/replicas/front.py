"""A front over the engine replicas, for the HTTP server (build_app): an EngineClient
(engine/client.py) like AsyncLLM.

Requests go through the replicas' Ray Serve handle, so Ray Serve's request router (ours,
router.py) picks the replica. A request whose replica dies before it streamed anything is
retried once (the router routes it afresh, and Ray Serve no longer offers the dead replica);
one that already streamed ends with EngineError. Whole-service calls (reset) go to every
replica the hub knows. Pins by id, cached contents and the KV event feed live in one engine
and are refused here; a cached content's create is refused before any replica pins it.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import MISSING, fields
from typing import TYPE_CHECKING, AsyncIterator, Callable, Optional, Sequence

from ray.exceptions import RayError, RayTaskError

from prefixserve.engine import CachePin, EngineInfo, EngineStats, RequestOutput
from prefixserve.engine.client import until_finished
from prefixserve.errors import EngineError, InvalidRequestError, PrefixServeError
from prefixserve.replicas.deployment import ACCEPTED
from prefixserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from prefixserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
_NO_CONTENTS = "cached contents are not available with --replicas (each lives in one engine)"
_NO_PINS = ("pins by id are not available with --replicas (each lives in one engine); "
            "ask for them with a request's cache_pins")
_NO_FEED = "the KV event feed is per replica; the replicas publish theirs to the hub"


def _cause(exc: BaseException) -> BaseException:
    """Our own errors raised in a replica arrive wrapped by Ray; the server maps the original."""
    if isinstance(exc, RayTaskError) and isinstance(exc.cause, PrefixServeError):
        return exc.cause
    return exc


def _lost_replica(exc: BaseException) -> bool:
    return isinstance(exc, RayError) and not isinstance(_cause(exc), PrefixServeError)


class ReplicaStream:
    """Outputs of one request on one replica (after its ACCEPTED marker)."""

    def __init__(self, request_id: str, response, replica: str,
                 on_done: Callable[[str], None]) -> None:
        self.request_id = request_id
        self.replica = replica   # the replica serving it (Ray Serve's replica id)
        self._response = response
        self._on_done = on_done

    def __aiter__(self) -> ReplicaStream:
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            output = await self._response.__anext__()
            if output.finished:
                self._on_done(self.request_id)
            return output
        except BaseException as exc:
            self._on_done(self.request_id)
            if not isinstance(exc, Exception) or isinstance(exc, StopAsyncIteration):
                raise
            cause = _cause(exc)
            if cause is not exc:
                raise cause from None
            if _lost_replica(exc):
                raise EngineError(f"the replica serving request {self.request_id} stopped "
                                  "after it started streaming") from None
            raise

    def cancel(self) -> None:
        self._response.cancel()


class ReplicatedLLM:
    info: EngineInfo
    tokenizer: Tokenizer
    max_model_len: int

    def __init__(self, handle, hub, *, info: EngineInfo, tokenizer, max_model_len: int,
                 stats_period_s: float = 0.5, call_timeout_s: float = 30.0) -> None:
        self._handle = handle
        self._gen = handle.options(stream=True, method_name="generate")
        self._hub = hub
        self.info = info
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._streams: dict[str, ReplicaStream] = {}
        self._stats = EngineStats(**{f.name: 0 for f in fields(EngineStats)
                                     if f.default is MISSING and f.default_factory is MISSING})
        self._replica_stats: dict[str, dict] = {}
        self._routing: dict[str, dict] = {}
        self._stats_period_s = stats_period_s
        self._call_timeout_s = call_timeout_s
        self._refresher: Optional[asyncio.Task] = None
        self.retries = 0   # requests sent again after their replica died before streaming

    # ------------------------------------------------------------ lifecycle
    @property
    def is_running(self) -> bool:
        return True

    @property
    def dead_reason(self) -> Optional[str]:
        return None

    def start(self) -> None:
        if self._refresher is None:
            self._refresher = asyncio.get_event_loop().create_task(self._refresh_forever())

    def shutdown(self, timeout: float = 30.0) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        for stream in list(self._streams.values()):
            stream.cancel()

    def now(self) -> float:
        return time.monotonic()

    async def _refresh_forever(self) -> None:
        while True:
            try:
                self._replica_stats = await self._hub.stats.remote()
                self._routing = await self._hub.routing.remote()
                self._stats = _sum_stats(list(self._replica_stats.values()), self._stats)
            except RayError as exc:
                logger.warning("replica stats unavailable: %s", exc)
            await asyncio.sleep(self._stats_period_s)

    def stats(self) -> EngineStats:
        return self._stats

    def replica_stats(self) -> dict[str, dict]:
        """Each replica's own engine stats, as it last published them."""
        return dict(self._replica_stats)

    async def routing(self) -> dict:
        """Each router's counts (decisions by reason, requests routed, loads, index size)."""
        return await self._hub.routing.remote()

    def last_routing(self) -> dict:
        """routing() as last refreshed (for a synchronous /metrics scrape)."""
        return dict(self._routing)

    # ------------------------------------------------------------- requests
    async def add_request(self, request_id: str, prompt, params: SamplingParams, *,
                          cache_salt: Optional[str] = None, priority: int = 0,
                          cache_pins: Sequence[CachePin] = (), tenant: Optional[str] = None) -> ReplicaStream:
        if any(pin.content is not None for pin in cache_pins):
            # Its get, use and delete would be refused here: it must not be created (and pinned)
            # on whichever replica the router picks.
            raise InvalidRequestError(_NO_CONTENTS, code="not_supported")
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            token_ids = list(prompt["prompt_token_ids"])
        else:
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        for attempt in (0, 1):
            response = self._gen.remote(request_id=request_id, token_ids=token_ids, params=params,
                                        cache_salt=cache_salt, priority=priority,
                                        cache_pins=tuple(cache_pins), tenant=tenant)
            try:
                marker = await response.__anext__()
            except Exception as exc:
                cause = _cause(exc)
                if cause is not exc:
                    raise cause from None
                if attempt == 0 and _lost_replica(exc):
                    # Nothing streamed yet: the request never ran anywhere the client can see.
                    self.retries += 1
                    logger.warning("replica lost before request %s started (%s); retrying once",
                                   request_id, type(exc).__name__)
                    continue
                raise EngineError(f"request {request_id} could not be served: its replica "
                                  "stopped") from None
            assert marker[0] == ACCEPTED
            stream = ReplicaStream(request_id, response, marker[1], self._forget_stream)
            self._streams[request_id] = stream
            return stream
        raise AssertionError("unreachable")

    async def generate(self, request_id: str, prompt, params: SamplingParams, *,
                       cache_salt: Optional[str] = None, priority: int = 0,
                       cache_pins: Sequence[CachePin] = (), tenant: Optional[str] = None
                       ) -> AsyncIterator[RequestOutput]:
        """add_request + iterate; the request is aborted if the iteration stops early."""
        stream = await self.add_request(request_id, prompt, params, cache_salt=cache_salt,
                                        priority=priority, cache_pins=cache_pins, tenant=tenant)
        async with contextlib.aclosing(until_finished(stream, lambda: self.abort(request_id))) as outputs:
            async for output in outputs:
                yield output

    def _forget_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.cancel()

    async def reset_prefix_cache(self) -> int:
        replicas = list(await self._hub.stats.remote())
        # A replica that died since it last published cannot be routed to: do not wait for it.
        counts = await asyncio.gather(*[asyncio.wait_for(
            self._handle.reset_prefix_cache.remote(target_replica=r), self._call_timeout_s)
            for r in replicas], return_exceptions=True)
        return sum(c for c in counts if isinstance(c, int))

    # ---------------------------------------------------- not across replicas
    async def pin_prefix(self, token_ids, *, cache_salt=None, num_tokens=None, ttl_s=None,
                         shorten=False, tenant=None):
        raise InvalidRequestError(_NO_PINS, code="not_supported")

    async def unpin(self, pin_id):
        raise InvalidRequestError(_NO_PINS, param="pin_id", code="not_supported")

    async def list_pins(self):
        raise InvalidRequestError(_NO_PINS, code="not_supported")

    async def kv_snapshot(self):
        raise InvalidRequestError(_NO_FEED, code="not_supported")

    async def kv_events(self):
        raise InvalidRequestError(_NO_FEED, code="not_supported")

    async def cached_contents(self, owner=None):
        raise InvalidRequestError(_NO_CONTENTS, code="not_supported")

    async def find_cached_content(self, key, owner=None, param="cached_content"):
        raise InvalidRequestError(_NO_CONTENTS, param=param, code="not_supported")

    async def cached_content_name_taken(self, name, owner=None):
        raise InvalidRequestError(_NO_CONTENTS, code="not_supported")

    async def repin_cached_content(self, key, ttl_s, owner=None, param="key"):
        raise InvalidRequestError(_NO_CONTENTS, param=param, code="not_supported")

    async def delete_cached_content(self, key, owner=None, param="key"):
        raise InvalidRequestError(_NO_CONTENTS, param=param, code="not_supported")


def _sum_stats(per_replica: list[dict], previous: EngineStats) -> EngineStats:
    if not per_replica:
        return previous
    merged = {}
    for f in fields(EngineStats):
        values = [s[f.name] for s in per_replica if f.name in s]
        if values and all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            merged[f.name] = sum(values)
        elif values:
            merged[f.name] = values[0]
    return EngineStats(**merged)
