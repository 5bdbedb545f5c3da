"""A front over the engine replicas, for the HTTP server (build_app): an EngineClient
(engine/client.py) like AsyncLLM.

Requests go through the replicas' Ray Serve handle, so Ray Serve's request router (ours,
router.py) picks the replica. A request whose replica dies before it streamed anything is
retried once (the router routes it afresh, and Ray Serve no longer offers the dead replica);
one that already streamed ends with EngineError. Whole-service calls (reset) go to every
replica the hub knows. Pins by id and the KV event feed live in one engine and are refused
here. A prompt's images come prepared (decoded, resized, patched and hashed by the server's render
process, within its --max-image-bytes / --max-image-pixels caps), or are prepared here, off the event
loop, as the engines would (multimodal/prompt.py with the replicas' vision settings,
EngineInfo.vision): the router hashes the expanded prompt with each image's content hash in the
blocks it overlaps, running no image code, and the chosen replica's engine takes the prepared images
as they are, so each picture is processed once. A cached content is created on the replica the
router picks for its tokens, and the front's directory (contents.py) sends its get, re-pin and
delete there, and creates it again where the router now picks when that replica is gone.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from dataclasses import MISSING, fields
from typing import TYPE_CHECKING, AsyncIterator, Callable, Optional, Sequence

from ray.exceptions import RayError, RayTaskError

from prefixserve.engine import CachedContent, CachePin, EngineInfo, EngineStats, PinInfo, RequestOutput
from prefixserve.engine.client import until_finished
from prefixserve.errors import EngineError, InvalidRequestError, NotFoundError, PrefixServeError
from prefixserve.multimodal.prompt import PreparedImages, expand_prompt, prepare_images
from prefixserve.replicas.contents import ContentDirectory, Placement
from prefixserve.replicas.deltas import DeltaDecoder
from prefixserve.replicas.deployment import ACCEPTED
from prefixserve.replicas.stats_merge import sum_replica_stats
from prefixserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from prefixserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
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
    """Outputs of one request on one replica (after its ACCEPTED marker), rebuilt whole from
    the deltas the replica sends."""

    def __init__(self, request_id: str, response, replica: str,
                 on_done: Callable[[str], None], decoder: DeltaDecoder) -> None:
        self.request_id = request_id
        self.replica = replica   # the replica serving it (Ray Serve's replica id)
        self._response = response
        self._on_done = on_done
        self._decoder = decoder
        # Told the final output (None: the stream failed) before the stream ends.
        self.on_final: Optional[Callable[[Optional[RequestOutput]], None]] = None

    def _final(self, output: Optional[RequestOutput]) -> None:
        on_final, self.on_final = self.on_final, None
        if on_final is not None:
            on_final(output)

    def __aiter__(self) -> ReplicaStream:
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            output = self._decoder.decode(await self._response.__anext__())
            if output.finished:
                self._final(output)
                self._on_done(self.request_id)
            return output
        except BaseException as exc:
            self._final(None)
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
        self._final(None)
        self._response.cancel()


class ReplicatedLLM:
    info: EngineInfo
    tokenizer: Tokenizer
    max_model_len: int

    def __init__(self, handle, hub, *, info: EngineInfo, tokenizer, max_model_len: int,
                 stats_period_s: float = 0.5, call_timeout_s: float = 30.0,
                 max_cached_contents_per_tenant: Optional[int] = None) -> None:
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
        self._contents = ContentDirectory(max_cached_contents_per_tenant)
        self._recreating = asyncio.Lock()
        self._content_requests = itertools.count()

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
                self._stats = sum_replica_stats(list(self._replica_stats.values()), self._stats)
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
                          cache_pins: Sequence[CachePin] = (),
                          cache_write_limit: Optional[int] = None,
                          routing_key: Optional[str] = None,
                          tenant: Optional[str] = None) -> ReplicaStream:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            token_ids = list(prompt["prompt_token_ids"])
        elif isinstance(prompt, dict):
            token_ids = self.tokenizer.encode(prompt.get("prompt", ""), add_special_tokens=True)
        else:
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        images, image_spans = None, ()
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            token_ids, images, image_spans = await self._images(token_ids, prompt["multi_modal_data"])
        # A content's name and its tenant's count are taken here, before any await, so two
        # creates racing to different replicas cannot both have them.
        self._contents.expire(self.now())
        creating: list[tuple[int, CachedContent]] = []
        try:
            for i, pin in enumerate(cache_pins):
                if pin.content is not None:
                    self._contents.reserve(pin.content)
                    creating.append((i, pin.content))
            stream = await self._send(request_id, token_ids, params, cache_salt, priority,
                                      cache_pins, cache_write_limit, routing_key, tenant,
                                      images=images, image_spans=image_spans)
        except BaseException:
            for _, content in creating:
                self._contents.release(content)
            raise
        if creating:
            stream.on_final = lambda out: self._created(creating, stream.replica, out)
        return stream

    async def _images(self, token_ids: list[int], data) -> tuple[list[int], PreparedImages, tuple]:
        """(the prompt expanded to its images' tokens, the images prepared for the replica, their spans).
        Each picture is decoded and processed once: here (or before, by the server's render process),
        and the replica's engine takes the result as it is."""
        param = "multi_modal_data"
        vision = self.info.vision
        if vision is None:
            raise InvalidRequestError("this model takes no images", param=param)
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise InvalidRequestError("multi_modal_data must be a dict with an 'image' entry", param=param)
        images = data.get("image")
        if isinstance(images, PreparedImages):
            prepared = images
        else:
            images = list(images) if isinstance(images, (list, tuple)) else [images]
            prepared = PreparedImages(tuple(await asyncio.to_thread(prepare_images, images, vision,
                                                                    param=f"{param}.image")))
        expanded, multimodal = expand_prompt(token_ids, prepared.items, vision, param=f"{param}.image")
        return expanded, prepared, multimodal.image_spans

    def _created(self, creating: list[tuple[int, CachedContent]], replica: str,
                 output: Optional[RequestOutput]) -> None:
        """Records the contents a finished create placed on its replica."""
        for i, content in creating:
            self._contents.release(content)
            result = output.pins[i] if output is not None and i < len(output.pins) else None
            if result is not None and result.error is None and result.pin_id is not None:
                self._contents.add(content, Placement(replica, result.expires_at))

    async def _send(self, request_id: str, token_ids: list[int], params: SamplingParams,
                    cache_salt: Optional[str], priority: int,
                    cache_pins: Sequence[CachePin], cache_write_limit: Optional[int] = None,
                    routing_key: Optional[str] = None, tenant: Optional[str] = None,
                    images: Optional[PreparedImages] = None, image_spans: tuple = ()) -> ReplicaStream:
        for attempt in (0, 1):
            # image_spans are the router's (router.py), images the replica's
            response = self._gen.remote(request_id=request_id, token_ids=token_ids, params=params,
                                        cache_salt=cache_salt, priority=priority,
                                        cache_pins=tuple(cache_pins),
                                        cache_write_limit=cache_write_limit,
                                        routing_key=routing_key, tenant=tenant,
                                        images=images, image_spans=image_spans)
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
            stream = ReplicaStream(request_id, response, marker[1], self._forget_stream,
                                   DeltaDecoder(request_id, token_ids, cache_salt, image_spans))
            self._streams[request_id] = stream
            return stream
        raise AssertionError("unreachable")

    async def generate(self, request_id: str, prompt, params: SamplingParams, *,
                       cache_salt: Optional[str] = None, priority: int = 0,
                       cache_pins: Sequence[CachePin] = (),
                       cache_write_limit: Optional[int] = None,
                       routing_key: Optional[str] = None,
                       tenant: Optional[str] = None) -> AsyncIterator[RequestOutput]:
        """add_request + iterate; the request is aborted if the iteration stops early."""
        stream = await self.add_request(request_id, prompt, params, cache_salt=cache_salt,
                                        priority=priority, cache_pins=cache_pins,
                                        cache_write_limit=cache_write_limit, routing_key=routing_key,
                                        tenant=tenant)
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
        # Every replica dropped its contents with its pins.
        self._contents.clear()
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

    # ------------------------------------------------------------ cached contents
    async def cached_contents(self, owner: Optional[str] = None) -> list[tuple[CachedContent, PinInfo]]:
        self._contents.expire(self.now())
        found = []
        for content in self._contents.visible(owner):
            try:
                found.append(await self._on_home(content, "find_cached_content", content.id,
                                                 owner, "key"))
            except NotFoundError:
                continue   # expired on its replica just now
        return found

    async def find_cached_content(self, key: str, owner: Optional[str] = None,
                                  param: str = "cached_content") -> tuple[CachedContent, PinInfo]:
        self._contents.expire(self.now())
        content = self._contents.find(key, owner, param)
        return await self._on_home(content, "find_cached_content", content.id, owner, param)

    async def cached_content_name_taken(self, name: str, owner: Optional[str] = None) -> bool:
        self._contents.expire(self.now())
        return self._contents.name_taken(name, owner)

    async def repin_cached_content(self, key: str, ttl_s: float, owner: Optional[str] = None,
                                   param: str = "key") -> tuple[CachedContent, PinInfo]:
        self._contents.expire(self.now())
        content = self._contents.find(key, owner, param)
        return await self._on_home(content, "repin_cached_content", content.id, ttl_s, owner, param)

    async def delete_cached_content(self, key: str, owner: Optional[str] = None,
                                    param: str = "key") -> CachedContent:
        self._contents.expire(self.now())
        content = self._contents.find(key, owner, param)
        if await self._alive(self._contents.placement(content).replica):
            await self._on_home(content, "delete_cached_content", content.id, owner, param)
        if self._contents.holds(content):
            self._contents.remove(content)   # (gone with its replica: nothing to release)
        return content

    async def _on_home(self, content: CachedContent, method: str, *args):
        """Calls `method` on the replica holding content (created again first where that
        replica is gone); the front's content with the replica's pin where it answers with
        one. A content its replica no longer holds (expired) is forgotten: NotFoundError."""
        for attempt in (0, 1):
            placement = self._contents.placement(content)
            if not await self._alive(placement.replica):
                placement = await self._recreate(content, placement)
            try:
                answer = await asyncio.wait_for(getattr(self._handle, method).remote(
                    *args, target_replica=placement.replica), self._call_timeout_s)
            except Exception as exc:
                cause = _cause(exc)
                if isinstance(cause, NotFoundError):
                    if self._contents.holds(content):
                        self._contents.remove(content)
                    raise cause from None
                if cause is not exc:
                    raise cause from None
                if attempt == 0 and (_lost_replica(exc) or isinstance(exc, asyncio.TimeoutError)):
                    self._replica_stats.pop(placement.replica, None)
                    continue
                raise EngineError(f"cached content {content.id} could not be reached: its "
                                  "replica stopped") from None
            if isinstance(answer, tuple):
                _, pin = answer
                placement.expires_at = pin.expires_at
                return content, pin
            return answer
        raise AssertionError("unreachable")

    async def _alive(self, replica: str) -> bool:
        if replica in self._replica_stats:
            return True
        # The hub forgets a replica as soon as a router sees it die; the front's copy of the
        # hub's view may just be older than a replica that started since.
        self._replica_stats = await self._hub.stats.remote()
        return replica in self._replica_stats

    async def _recreate(self, content: CachedContent, gone: Placement) -> Placement:
        """Creates content again from its definition, on the replica the router picks now, with
        what was left of its TTL; one re-creation at a time, so two callers make it once."""
        async with self._recreating:
            placement = self._contents.placement(content)
            if placement is not gone:
                return placement   # another caller made it while this one waited
            ttl_s = None if gone.expires_at is None else gone.expires_at - self.now()
            if ttl_s is not None and ttl_s <= 0:
                self._contents.remove(content)
                raise NotFoundError(f"no cached content {content.id!r} (it expired)",
                                    code="cached_content_not_found")
            logger.warning("replica %s holding cached content %s is gone; creating it again",
                           gone.replica, content.id)
            again = dataclasses.replace(content, pin_id=None)
            stream = await self._send(
                f"cc-again-{next(self._content_requests)}", list(content.token_ids),
                SamplingParams(temperature=0.0, max_tokens=1), content.cache_salt, 0,
                [CachePin(len(content.token_ids), ttl_s, content=again, tenant=content.tenant)],
                tenant=content.tenant)
            output = None
            async for output in stream:
                pass
            result = output.pins[0] if output is not None and output.pins else None
            if result is None or result.pin_id is None or result.error is not None:
                self._contents.remove(content)
                raise EngineError(f"cached content {content.id} was lost with its replica and "
                                  f"could not be created again: "
                                  f"{result.error if result is not None else 'nothing pinned'}")
            placement = Placement(stream.replica, result.expires_at)
            self._contents.place(content, placement)
            return placement

