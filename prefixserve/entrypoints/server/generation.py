"""Submitting one HTTP request's prompts to the engine, following their outputs and aborting them
on client disconnect (the pipeline's submit stage, also what a cached content's prefill uses)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional, Sequence

from fastapi import Request

from prefixserve.engine.async_llm import AsyncLLM, RequestStream
from prefixserve.engine.outputs import CachePin, RequestOutput
from prefixserve.entrypoints.server.config import ServerConfig
from prefixserve.entrypoints.server.errors import APIError, api_error
from prefixserve.entrypoints.server.metrics import RequestRecorder, ServerMetrics
from prefixserve.multimodal.prompt import PreparedImages
from prefixserve.sampling_params import SamplingParams


@dataclass
class Generation:
    """The engine requests (one per prompt) behind one HTTP request."""
    async_llm: AsyncLLM
    request_ids: list[str]
    streams: list[RequestStream]
    recorders: list[RequestRecorder]
    config: ServerConfig
    param: str
    samples_per_prompt: int = 1
    finished: set[int] = field(default_factory=set)

    def abort(self) -> None:
        """Aborts every prompt not yet finished (idempotent; safe after completion)."""
        for i, rid in enumerate(self.request_ids):
            if i not in self.finished:
                self.finished.add(i)
                self.async_llm.abort(rid)
                self.recorders[i].aborted(self.samples_per_prompt)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, cumulative output) as they arrive from every prompt, until all finish.

        Raises APIError when the engine ends a request with an error.
        """
        if len(self.streams) == 1:
            async for output in self._follow(0):
                yield 0, output
            return
        # Outputs are cumulative: keep only each prompt's newest, so a slow client costs no memory.
        latest: dict[int, RequestOutput] = {}
        errors: list[Exception] = []
        done: set[int] = set()
        wake = asyncio.Event()

        async def pump(i: int) -> None:
            try:
                async for output in self._follow(i):
                    latest[i] = output
                    wake.set()
            except Exception as exc:  # handed to the reader
                errors.append(exc)
            finally:
                done.add(i)
                wake.set()

        tasks = [asyncio.create_task(pump(i)) for i in range(len(self.streams))]
        try:
            while True:
                await wake.wait()
                wake.clear()
                if errors:
                    raise errors[0]
                ready = sorted(latest.items())
                latest.clear()
                for item in ready:
                    yield item
                if len(done) == len(tasks) and not latest:
                    return
        finally:
            for task in tasks:
                task.cancel()

    async def _follow(self, i: int) -> AsyncIterator[RequestOutput]:
        try:
            async for output in self.streams[i]:
                self.recorders[i].observe(output)
                if output.error is not None:
                    raise APIError(500, f"the engine ended the request: {output.error}",
                                   type="server_error", code="engine_error")
                if output.finished:
                    self.finished.add(i)
                yield output
        except APIError:
            raise
        except Exception as exc:
            raise api_error(exc, param=self.param, retry_after_s=self.config.retry_after_s,
                            renames={"prompt": self.param})

    async def _abort_on_disconnect(self, request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.abort()

    async def first_output(self, request: Request
                           ) -> tuple[RequestOutput, AsyncIterator[tuple[int, RequestOutput]]]:
        """For one prompt: waits for its first output (the prompt is computed and its pins are
        placed by then) and returns it with the iterator of the outputs after it. Aborts if the
        client disconnects first."""
        outputs = self.outputs()
        watcher = asyncio.create_task(self._abort_on_disconnect(request))
        try:
            _, first = await outputs.__anext__()
        except BaseException:
            self.abort()
            await outputs.aclose()
            raise
        finally:
            watcher.cancel()
        return first, outputs

    async def final_outputs(self, request: Request) -> list[RequestOutput]:
        """Waits for every prompt to finish; aborts them all if the client disconnects first."""
        watcher = asyncio.create_task(self._abort_on_disconnect(request))
        last: dict[int, RequestOutput] = {}
        try:
            async for i, output in self.outputs():
                last[i] = output
        finally:
            watcher.cancel()
            self.abort()
        return [last[i] for i in range(len(self.streams))]


async def submit(async_llm: AsyncLLM, config: ServerConfig, metrics: ServerMetrics, base_id: str,
                 prompts: list[list[int]], params: SamplingParams, *, cache_salt: Optional[str],
                 priority: int, param: str, cache_pins: Sequence[CachePin] = (),
                 cache_write_limit: Optional[int] = None, routing_key: Optional[str] = None,
                 renames: Optional[dict[str, str]] = None, images: Optional[PreparedImages] = None,
                 tenant: Optional[str] = None) -> Generation:
    """Adds every prompt (for tenant, the caller's: its share of the queue, the steps and the
    cache); if any is refused, aborts the ones already added and raises APIError (a 429 is
    counted against tenant). images: a chat prompt's pictures, in the order of their parts, prepared
    by the render process."""
    ids = [base_id if len(prompts) == 1 else f"{base_id}-{i}" for i in range(len(prompts))]
    streams: list[RequestStream] = []
    try:
        for rid, prompt in zip(ids, prompts):
            request: dict = {"prompt_token_ids": prompt}
            if images:
                request["multi_modal_data"] = {"image": images}
            streams.append(await async_llm.add_request(
                rid, request, params, cache_salt=cache_salt, priority=priority,
                cache_pins=cache_pins, cache_write_limit=cache_write_limit,
                routing_key=routing_key, tenant=tenant))
    except BaseException as exc:
        for rid in ids[:len(streams)]:
            async_llm.abort(rid)
        if isinstance(exc, Exception):
            error = api_error(exc, param=param, retry_after_s=config.retry_after_s,
                              renames={"prompt": param, "multi_modal_data": param, "multi_modal_data.image": param,
                                       **(renames or {})})
            if error.status == 429:
                metrics.refused(tenant)
            raise error from exc
        raise
    return Generation(async_llm, ids, streams, [metrics.recorder() for _ in ids], config, param, params.n)
