"""One engine replica: an AsyncLLM inside a Ray Serve replica, publishing its KV events.

The replica serves token ids (the front renders and tokenizes once, and the router hashes the
same ids), streams what each output adds to the last (deltas.py: bytes through Ray linear in
the output's length, not quadratic), and pushes what its pool holds to the hub: a snapshot when
it starts (so a restarted replica's blocks are known again), then its events every
`publish_period_s`. Only the engine's public API is used. It serves the calls the front
(front.py) forwards through the Ray Serve handle, in the remote role engine/client.py describes.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator, Optional, Sequence

import ray
from ray import serve

from prefixserve.engine import AsyncLLM, CachePin, EngineConfig, LLMEngine
from prefixserve.multimodal.prompt import PreparedImages
from prefixserve.replicas.deltas import DeltaEncoder
from prefixserve.sampling_params import SamplingParams

ACCEPTED = "accepted"   # first item of every stream: the engine queued the request


class EngineReplica:
    def __init__(self, engine_config: EngineConfig, hub_name: str, namespace: str,
                 max_waiting: Optional[int] = None, publish_period_s: float = 0.05) -> None:
        self.llm = AsyncLLM(LLMEngine(engine_config), max_waiting=max_waiting)
        self.llm.start()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._hub = ray.get_actor(hub_name, namespace=namespace)
        self._period = publish_period_s
        self._publisher: Optional[asyncio.Task] = None

    def _ensure_publisher(self) -> None:
        if self._publisher is None or self._publisher.done():
            self._publisher = asyncio.get_running_loop().create_task(self._publish_forever())

    async def _publish_forever(self) -> None:
        snapshot: Optional[list[bytes]] = await self.llm.kv_snapshot()
        while True:
            stats = dataclasses.asdict(self.llm.stats())
            stats["model_identity"] = self.llm.info.model_identity
            stats["kv_store_scope"] = self.llm.info.kv_store_scope
            batch = None if snapshot is not None else await self.llm.kv_events()
            ok = await self._hub.publish.remote(self.replica_id, batch, snapshot, stats)
            snapshot = None if ok else await self.llm.kv_snapshot()
            await asyncio.sleep(self._period)

    async def check_health(self) -> None:
        self._ensure_publisher()
        if not self.llm.is_running:
            raise RuntimeError(self.llm.dead_reason or "the engine loop is not running")

    async def identify(self, target_replica: Optional[str] = None) -> dict:
        """Who this replica is and what it serves (the front builds its EngineInfo from it)."""
        self._ensure_publisher()
        return {"replica": self.replica_id, "info": self.llm.info,
                "max_model_len": self.llm.max_model_len}

    async def generate(self, request_id: str, token_ids: Sequence[int], params: SamplingParams, *,
                       cache_salt: Optional[str] = None, priority: int = 0,
                       cache_pins: Sequence[CachePin] = (),
                       cache_write_limit: Optional[int] = None,
                       routing_key: Optional[str] = None,
                       tenant: Optional[str] = None, images: Optional[PreparedImages] = None,
                       image_spans: tuple = ()) -> AsyncIterator:
        # routing_key and image_spans were read by the router (router.py) before this replica was
        # chosen; images come prepared by the front (their patches and the hashes it routed by), so
        # the engine takes them as they are and no picture is processed twice
        self._ensure_publisher()
        prompt: dict = {"prompt_token_ids": list(token_ids)}
        if images:
            prompt["multi_modal_data"] = {"image": images}
        stream = await self.llm.add_request(request_id, prompt,
                                            params, cache_salt=cache_salt, priority=priority,
                                            cache_pins=cache_pins,
                                            cache_write_limit=cache_write_limit, tenant=tenant)
        deltas = DeltaEncoder()
        try:
            yield (ACCEPTED, self.replica_id)
            async for output in stream:
                yield deltas.encode(output)
        finally:
            # Cancelled by the front (client gone) or finished: either way nothing keeps running.
            self.llm.abort(request_id)

    async def reset_prefix_cache(self, target_replica: Optional[str] = None) -> int:
        return await self.llm.reset_prefix_cache()

    # A cached content lives in the replica it was created on; the front sends these there.
    async def find_cached_content(self, key: str, owner: Optional[str] = None,
                                  param: str = "cached_content",
                                  target_replica: Optional[str] = None) -> tuple:
        return await self.llm.find_cached_content(key, owner, param)

    async def repin_cached_content(self, key: str, ttl_s: float, owner: Optional[str] = None,
                                   param: str = "key", target_replica: Optional[str] = None) -> tuple:
        return await self.llm.repin_cached_content(key, ttl_s, owner, param)

    async def delete_cached_content(self, key: str, owner: Optional[str] = None,
                                    param: str = "key", target_replica: Optional[str] = None):
        return await self.llm.delete_cached_content(key, owner, param)

    def __del__(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.shutdown(timeout=5.0)
