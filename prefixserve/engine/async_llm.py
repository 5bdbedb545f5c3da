"""Drives an LLMEngine from one background thread for asyncio callers.

The engine is not thread-safe, so exactly one thread (the engine loop) ever
touches it. asyncio code talks to that thread through a command list guarded
by a condition variable: adding a request, aborting one, or running any
function on the engine between two steps. Outputs travel back the other way
through `loop.call_soon_threadsafe`.

Outputs are cumulative, so a request's stream keeps only the newest one: a
slow consumer sees fewer, larger updates instead of an ever-growing backlog.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Callable, Optional, Sequence, TypeVar

from prefixserve.engine.cached_contents import CachedContent
from prefixserve.engine.client import until_finished
from prefixserve.engine.intake import PromptInput, needs_preparing
from prefixserve.engine.llm_engine import LLMEngine
from prefixserve.engine.outputs import CachePin, EngineInfo, EngineStats, PinInfo, RequestOutput
from prefixserve.errors import (DuplicateRequestError, EngineDeadError, EngineStepError, QueueFullError,
                                RequestAbortedError)
from prefixserve.sampling_params import SamplingParams
from prefixserve.scheduler.tenants import tenant_share

if TYPE_CHECKING:
    from prefixserve.kv.events import KVEventBatch

logger = logging.getLogger(__name__)
T = TypeVar("T")


class RequestStream:
    """The asyncio side of one request: async-iterates its (cumulative) outputs until finished."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: Optional[RequestOutput] = None
        self._error: Optional[BaseException] = None
        self._wake_scheduled = False
        self._event = asyncio.Event()
        self._done = False

    # ---- engine-loop thread side
    def _put(self, output: RequestOutput) -> None:
        with self._lock:
            self._pending = output
            self._schedule_wake_locked()

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            self._error = error
            self._schedule_wake_locked()

    def _schedule_wake_locked(self) -> None:
        if self._wake_scheduled:
            return
        self._wake_scheduled = True
        # Raises RuntimeError if the consumer's loop has closed; the caller aborts then.
        self._loop.call_soon_threadsafe(self._wake)

    # ---- event-loop side
    def _wake(self) -> None:
        with self._lock:
            self._wake_scheduled = False
        self._event.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self._done:
                raise StopAsyncIteration
            self._event.clear()
            with self._lock:
                output, self._pending = self._pending, None
                error = self._error
            if output is not None:
                self._done = output.finished
                return output
            if error is not None:
                self._done = True
                raise error
            await self._event.wait()


@dataclass
class _Command:
    """Work for the engine thread; `fail` tells its waiter when it will never run."""
    run: Callable[[], None]
    fail: Callable[[BaseException], None] = lambda exc: None
    seats: int = 0  # sequences an add brings (n), counted against max_waiting until the engine holds them
    tenant: Optional[str] = None  # whose seats they are (a tenant's share of max_waiting)


class AsyncLLM:
    """Thread-safe, asyncio-facing front of an LLMEngine run by one background thread: an
    EngineClient (engine/client.py).

    max_waiting bounds the sequences accepted and not finished (a request counts
    its n; those still in the command list included); beyond it add_request
    raises QueueFullError at once. Any of them may have to wait, a preempted one
    too, so the waiting queue never holds more than max_waiting, and memory stays
    bounded under overload.
    """

    def __init__(self, engine: LLMEngine, *, max_waiting: Optional[int] = None) -> None:
        if max_waiting is not None and (isinstance(max_waiting, bool) or not isinstance(max_waiting, int)
                                        or max_waiting < 1):
            raise ValueError(f"max_waiting must be a positive integer or None, got {max_waiting!r}")
        self.engine = engine
        self.max_waiting = max_waiting
        self._cond = threading.Condition()
        self._commands: deque[_Command] = deque()
        self._pending_seats = 0
        self._pending_by_tenant: dict[str, int] = {}
        # Each weighted tenant's share of max_waiting; fair scheduling off: one queue for all.
        self._weights = dict(engine.config.tenant_weights) if engine.config.fair_scheduling else {}
        self._streams: dict[str, RequestStream] = {}
        # Requests the engine holds that this front added; only the engine thread touches it.
        self._in_engine: set[str] = set()
        self._stats: EngineStats = engine.stats()
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self._dead: Optional[str] = None
        # Grammars compile here, off the engine thread: a slow one would stall every stream.
        # Two workers, so one slow grammar does not hold up everyone else's either.
        self._compiler = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="prefixserve-grammar")

    # ------------------------------------------------------------- lifecycle
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def info(self) -> EngineInfo:
        """What the engine serves and how (model, dtype, device, block size, limits); immutable."""
        return self.engine.info

    def now(self) -> float:
        """The engine's clock (pin expiries are given in it); safe from any thread."""
        return self.engine.clock()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    @property
    def dead_reason(self) -> Optional[str]:
        return self._dead

    def start(self) -> None:
        """Starts the engine loop thread (idempotent)."""
        with self._cond:
            self._check_alive_locked()
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run_loop, name="prefixserve-engine",
                                            daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops the loop after its current step; requests still in flight are failed."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        # Compiles under way finish and find the engine stopped (EngineDeadError).
        self._compiler.shutdown(wait=False)
        if thread is None:
            self._die("the engine was shut down")
        elif thread is not threading.current_thread():
            thread.join(timeout)

    # -------------------------------------------------------------- requests
    async def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams, *,
                          cache_salt: Optional[str] = None, priority: int = 0,
                          cache_pins: Sequence[CachePin] = (),
                          cache_write_limit: Optional[int] = None,
                          routing_key: Optional[str] = None,
                          tenant: Optional[str] = None) -> RequestStream:
        """Queues a request; returns its stream once the engine accepted it.

        cache_pins: prefixes to pin once the prompt is computed; cache_write_limit: how many
        leading prompt tokens may enter the cache (see LLMEngine.add_request); routing_key: where
        replicas would send it (one engine here: nothing to route).

        Raises QueueFullError (at the bound), InvalidRequestError (the engine refused it;
        nothing scheduled) or EngineDeadError.
        """
        loop = asyncio.get_running_loop()
        grammar = None
        if params.structured is not None:
            with self._cond:  # refused at once, before any compiling, when it would be anyway
                self._check_admission_locked(request_id, params, tenant)
            try:
                compiling = loop.run_in_executor(self._compiler, self.engine.compile_grammar, params)
            except RuntimeError:  # shut down since the check
                raise EngineDeadError("the engine is shutting down") from None
            # Raises InvalidRequestError when the grammar cannot be compiled: nothing is queued.
            grammar = await compiling
        if needs_preparing(prompt):
            # images are decoded, resized and hashed here, never on the engine thread or the event loop
            # (the server's come prepared by its render process, a replica's by its front)
            prompt = await loop.run_in_executor(self._compiler, self.engine.prepare_images, prompt)
        stream = RequestStream(request_id, loop)
        accepted: concurrent.futures.Future[None] = concurrent.futures.Future()

        def add() -> None:
            if not accepted.set_running_or_notify_cancel():
                with self._cond:
                    self._streams.pop(request_id, None)
                return
            try:
                self.engine.add_request(request_id, prompt, params, cache_salt=cache_salt,
                                        priority=priority, cache_pins=cache_pins, grammar=grammar,
                                        cache_write_limit=cache_write_limit, tenant=tenant)
            except BaseException as exc:  # handed to the caller, who maps it to an HTTP error
                with self._cond:
                    self._streams.pop(request_id, None)
                accepted.set_exception(exc)
            else:
                self._in_engine.add(request_id)
                accepted.set_result(None)

        def fail(exc: BaseException) -> None:
            _fail_future(accepted, exc)

        with self._cond:
            self._check_admission_locked(request_id, params, tenant)
            self._pending_seats += params.n
            if tenant is not None:
                self._pending_by_tenant[tenant] = self._pending_by_tenant.get(tenant, 0) + params.n
            self._streams[request_id] = stream
            self._commands.append(_Command(add, fail, seats=params.n, tenant=tenant))
            self._cond.notify()
        try:
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:
            # The caller went away before acceptance: make sure nothing keeps running for it.
            self.abort(request_id)
            raise
        return stream

    def _check_admission_locked(self, request_id: str, params: SamplingParams,
                                tenant: Optional[str]) -> None:
        self._check_alive_locked()
        if request_id in self._streams:
            raise DuplicateRequestError(f"request id {request_id!r} is already in use",
                                        param="request_id")
        if self.max_waiting is None:
            return
        if self._pending_seats + self._stats.num_seats + params.n > self.max_waiting:
            raise QueueFullError(f"too many requests in flight (max_waiting={self.max_waiting}); "
                                 "retry later")
        # A weighted tenant is held to its share, so a flood of one tenant's fills only its own
        # part of the queue and the others keep theirs.
        share = tenant_share(self.max_waiting, self._weights, tenant)
        if share is not None and tenant is not None:
            held = self._pending_by_tenant.get(tenant, 0) + self._stats.seats_by_tenant.get(tenant, 0)
            if held + params.n > share:
                raise QueueFullError(f"tenant {tenant!r} has its share of the queue in flight "
                                     f"({share} of max_waiting={self.max_waiting}); retry later")

    async def generate(self, request_id: str, prompt: PromptInput, params: SamplingParams, *,
                       cache_salt: Optional[str] = None, priority: int = 0,
                       cache_pins: Sequence[CachePin] = (),
                       cache_write_limit: Optional[int] = None,
                       routing_key: Optional[str] = None,
                       tenant: Optional[str] = None) -> AsyncIterator[RequestOutput]:
        """add_request + iterate; the request is aborted if the iteration stops early.

        Leaving an `async for` with break does not close an async generator
        until it is garbage-collected: wrap the call in contextlib.aclosing()
        (or let the task be cancelled) to free the request's blocks at once.
        """
        stream = await self.add_request(request_id, prompt, params, cache_salt=cache_salt,
                                        priority=priority, cache_pins=cache_pins,
                                        cache_write_limit=cache_write_limit, tenant=tenant)
        async with contextlib.aclosing(until_finished(stream, lambda: self.abort(request_id))) as outputs:
            async for output in outputs:
                yield output

    def abort(self, request_id: str) -> None:
        """Aborts a request before the next engine step; unknown or finished ids are a no-op.

        Safe to call from any thread, and never blocks on the engine. A consumer
        still iterating the request's stream gets RequestAbortedError.
        """
        def abort() -> None:
            if request_id in self._in_engine:
                self._in_engine.discard(request_id)
                try:
                    self.engine.abort_request(request_id)
                except Exception:
                    logger.exception("aborting request %s failed", request_id)

        with self._cond:
            stream = self._streams.pop(request_id, None)
            if self._dead is None:
                self._commands.append(_Command(abort))
                self._cond.notify()
        if stream is not None:
            _fail_quietly(stream, RequestAbortedError(f"request {request_id} was aborted"))

    # ------------------------------------------------- cache control (each one atomic)
    async def reset_prefix_cache(self) -> int:
        return await self.run_in_engine(lambda e: e.reset_prefix_cache())

    async def pin_prefix(self, token_ids: Sequence[int], *, cache_salt: Optional[str] = None,
                         num_tokens: Optional[int] = None, ttl_s: Optional[float] = None,
                         shorten: bool = False, tenant: Optional[str] = None) -> PinInfo:
        return await self.run_in_engine(lambda e: e.pin_prefix(
            token_ids, cache_salt=cache_salt, num_tokens=num_tokens, ttl_s=ttl_s, shorten=shorten,
            tenant=tenant))

    async def kv_snapshot(self) -> list[bytes]:
        """See engine/kv_event_feed.py (KVEventFeed.snapshot)."""
        return await self.run_in_engine(lambda engine: engine.kv_snapshot())

    async def kv_events(self) -> KVEventBatch:
        """See engine/kv_event_feed.py (KVEventFeed.events)."""
        return await self.run_in_engine(lambda engine: engine.kv_events())

    async def unpin(self, pin_id: str) -> bool:
        return await self.run_in_engine(lambda e: e.unpin(pin_id))

    async def list_pins(self) -> list[PinInfo]:
        return await self.run_in_engine(lambda e: e.list_pins())

    async def cached_contents(self, owner: Optional[str] = None) -> list[tuple[CachedContent, PinInfo]]:
        return await self.run_in_engine(lambda e: e.cached_contents(owner))

    async def find_cached_content(self, key: str, owner: Optional[str] = None,
                                  param: str = "cached_content") -> tuple[CachedContent, PinInfo]:
        return await self.run_in_engine(lambda e: e.find_cached_content(key, owner, param))

    async def cached_content_name_taken(self, name: str, owner: Optional[str] = None) -> bool:
        return await self.run_in_engine(lambda e: e.cached_content_name_taken(name, owner))

    async def repin_cached_content(self, key: str, ttl_s: float, owner: Optional[str] = None,
                                   param: str = "key") -> tuple[CachedContent, PinInfo]:
        return await self.run_in_engine(lambda e: e.repin_cached_content(key, ttl_s, owner, param))

    async def delete_cached_content(self, key: str, owner: Optional[str] = None,
                                    param: str = "key") -> CachedContent:
        return await self.run_in_engine(lambda e: e.delete_cached_content(key, owner, param))

    async def run_in_engine(self, fn: Callable[[LLMEngine], T]) -> T:
        """Runs fn(engine) on the engine thread between two steps and returns its result.

        For tests and tools that inspect the engine; entry points use the named methods above."""
        return await asyncio.wrap_future(self.submit(fn))

    def submit(self, fn: Callable[[LLMEngine], T]) -> concurrent.futures.Future[T]:
        """Thread-safe: schedules fn(engine) on the engine thread; returns a future of its result."""
        result: concurrent.futures.Future[T] = concurrent.futures.Future()

        def call() -> None:
            if not result.set_running_or_notify_cancel():
                return
            try:
                result.set_result(fn(self.engine))
            except BaseException as exc:
                result.set_exception(exc)

        def fail(exc: BaseException) -> None:
            _fail_future(result, exc)

        with self._cond:
            self._check_alive_locked()
            self._commands.append(_Command(call, fail))
            self._cond.notify()
        return result

    def stats(self) -> EngineStats:
        """The engine's stats as of the loop's latest iteration (never blocks on the engine)."""
        return self._stats

    def _check_alive_locked(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine is not running: {self._dead}")
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")

    # ------------------------------------------------------------ the loop
    def _run_loop(self) -> None:
        reason = "the engine was shut down"
        commands: list[_Command] = []
        try:
            while True:
                with self._cond:
                    while not self._commands and not self._stopping and not self._in_engine:
                        self._cond.wait()
                    if self._stopping:
                        break
                    commands = list(self._commands)
                    self._commands.clear()
                for command in commands:
                    command.run()
                with self._cond:
                    # Counted as pending until the refreshed stats count them,
                    # so the max_waiting bound never sees a gap.
                    self._pending_seats -= sum(c.seats for c in commands)
                    for c in commands:
                        if c.tenant is not None:
                            left = self._pending_by_tenant[c.tenant] - c.seats
                            if left:
                                self._pending_by_tenant[c.tenant] = left
                            else:
                                del self._pending_by_tenant[c.tenant]
                    self._stats = self.engine.stats()
                if self._in_engine and not self.engine.has_unfinished_requests():
                    # The engine ended requests without a final output: never leave a waiter hanging.
                    self._fail_all_in_engine(EngineStepError("the engine dropped the request"))
                if self._in_engine:
                    self._step()
                    self._stats = self.engine.stats()
        except BaseException as exc:  # a bug outside step(): nothing can be trusted any more
            logger.exception("engine loop crashed")
            reason = f"engine loop crashed: {exc!r}"
            for command in commands:
                command.fail(EngineDeadError(reason))
        # Leave the engine empty (every block free) for whoever uses it next.
        self._fail_all_in_engine(EngineDeadError(reason))
        self._die(reason)
        if self._stopping:
            try:
                self.engine.close()   # a clean stop: the cache goes to the persistent KV stores
            except Exception:
                logger.exception("flushing the KV stores at shutdown failed")

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            # The engine contains failures of a request or of a forward and reports them per
            # request (below); one escaping step() broke its own bookkeeping, so nothing in it
            # can be trusted to continue.
            logger.exception("engine step failed; ending every request in the engine")
            self._fail_all_in_engine(EngineStepError(f"engine step failed: {exc!r}"))
            return
        failures = self.engine.last_step_failures()
        for output in outputs:
            if output.finished:
                self._in_engine.discard(output.request_id)
            with self._cond:
                stream = self._streams.get(output.request_id)
                if stream is not None and output.finished:
                    del self._streams[output.request_id]
            if stream is None:
                continue
            try:
                if output.finished and output.request_id in failures:
                    stream._fail(EngineStepError(failures[output.request_id]))
                else:
                    stream._put(output)
            except RuntimeError:
                # The consumer's event loop is closed: nobody will read this request.
                if not output.finished:
                    self._in_engine.discard(output.request_id)
                    self.engine.abort_request(output.request_id)

    def _fail_all_in_engine(self, error: BaseException) -> None:
        ids = sorted(self._in_engine)
        self._in_engine.clear()
        with self._cond:
            streams = [self._streams.pop(rid) for rid in ids if rid in self._streams]
        try:
            self.engine.abort_request(ids)
        except Exception:
            logger.exception("aborting the requests of a failed step raised too")
        for stream in streams:
            _fail_quietly(stream, error)

    def _die(self, reason: str) -> None:
        with self._cond:
            self._dead = reason
            streams = list(self._streams.values())
            self._streams.clear()
            commands = list(self._commands)
            self._commands.clear()
        error = EngineDeadError(reason)
        for command in commands:
            command.fail(error)
        for stream in streams:
            _fail_quietly(stream, error)


def _fail_future(future: concurrent.futures.Future, error: BaseException) -> None:
    if future.done():
        return
    if future.running() or future.set_running_or_notify_cancel():
        future.set_exception(error)


def _fail_quietly(stream: RequestStream, error: BaseException) -> None:
    try:
        stream._fail(error)
    except RuntimeError:  # its event loop is closed: nobody is listening
        pass


if TYPE_CHECKING:
    from prefixserve.engine.client import EngineClient
    _: type[EngineClient] = AsyncLLM   # mypy holds the front to the protocol's types
