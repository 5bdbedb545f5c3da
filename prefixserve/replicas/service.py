"""Starts and stops the replicated service: a Ray cluster (joined or local), the KV event hub,
the engine replicas as a Ray Serve application with our request router, and the front."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Optional

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from prefixserve.engine import EngineConfig, EngineInfo, with_concrete_dtype
from prefixserve.replicas.deployment import EngineReplica
from prefixserve.replicas.front import ReplicatedLLM
from prefixserve.replicas.hub import KVEventHub
from prefixserve.replicas.policy import RoutingConfig
from prefixserve.replicas.router import PrefixAwareRequestRouter


@dataclass(frozen=True)
class ReplicaConfig:
    num_replicas: int = 2
    ray_address: Optional[str] = None   # None: start a local cluster and stop it with the service
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    replica_cpus: float = 1.0           # CPUs Ray reserves for each replica (its torch threads)
    app_name: str = "prefixserve"
    max_ongoing_requests: int = 1024    # per replica; the engine's own queue bounds the rest
    health_check_period_s: float = 2.0

    def __post_init__(self) -> None:
        if isinstance(self.num_replicas, bool) or not isinstance(self.num_replicas, int) \
                or self.num_replicas < 1:
            raise ValueError(f"num_replicas must be an int >= 1, got {self.num_replicas!r}")
        if not isinstance(self.routing, RoutingConfig):
            raise ValueError("routing must be a RoutingConfig")
        if not self.replica_cpus > 0:
            raise ValueError(f"replica_cpus must be > 0, got {self.replica_cpus!r}")
        if not self.app_name or not self.app_name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"app_name must be letters, digits, '-' or '_', got {self.app_name!r}")
        if self.max_ongoing_requests < 1 or not self.health_check_period_s > 0:
            raise ValueError("max_ongoing_requests must be >= 1 and health_check_period_s > 0")


class ReplicaService:
    def __init__(self, engine_config: EngineConfig, config: ReplicaConfig,
                 max_waiting: Optional[int] = None) -> None:
        self.engine_config = engine_config
        self.config = config
        self.max_waiting = max_waiting
        self.namespace = f"prefixserve-{config.app_name}"
        self.hub_name = f"kv-event-hub-{config.app_name}"
        self._owns_cluster = False
        self.hub = None
        self.handle = None

    def start(self) -> ReplicatedLLM:
        """Deploys the replicas and waits until each answers; returns the front."""
        cfg = self.config
        if not ray.is_initialized():
            if cfg.ray_address is None:
                cpus = max(os.cpu_count() or 1, int(cfg.num_replicas * cfg.replica_cpus + 0.999))
                ray.init(num_cpus=cpus, namespace=self.namespace, include_dashboard=False,
                         log_to_driver=False)
                self._owns_cluster = True
            else:
                ray.init(address=cfg.ray_address, namespace=self.namespace, log_to_driver=False)
        serve.start(proxy_location="Disabled")
        self.hub = ray.remote(KVEventHub).options(
            name=self.hub_name, namespace=self.namespace, num_cpus=0, get_if_exists=True,
            lifetime=None).remote()
        router_kwargs = {
            "routing": dataclasses.asdict(cfg.routing), "hub_name": self.hub_name,
            "namespace": self.namespace, "hash_algo": self.engine_config.hash_algo,
            "block_size": self.engine_config.block_size,
            # stores every replica reaches alike, wherever it runs (not host memory or a local disk)
            "shared_stores": [u for u in self.engine_config.kv_stores if u.startswith(("redis:", "rediss:"))],
        }
        threads = str(max(1, int(cfg.replica_cpus)))
        deployment = serve.deployment(EngineReplica).options(
            name="EngineReplica", num_replicas=cfg.num_replicas,
            max_ongoing_requests=cfg.max_ongoing_requests,
            health_check_period_s=cfg.health_check_period_s,
            ray_actor_options={"num_cpus": cfg.replica_cpus,
                               "runtime_env": {"env_vars": {"OMP_NUM_THREADS": threads}}})
        deployment = deployment.options(request_router_config=RequestRouterConfig(
            request_router_class=PrefixAwareRequestRouter, request_router_kwargs=router_kwargs))
        # every replica in one dtype (engine/dtype_resolution.py)
        replicas, choice = with_concrete_dtype(self.engine_config)
        app = deployment.bind(replicas, self.hub_name, self.namespace, self.max_waiting)
        self.handle = serve.run(app, name=cfg.app_name, route_prefix=None)
        first = self.handle.identify.remote().result()
        info: EngineInfo = first["info"]
        if choice.dtype is not None and choice.requested != choice.dtype:
            info = dataclasses.replace(info, dtype_reason=f"{choice.reason}; resolved once for every replica")
        from prefixserve.tokenizer import load_tokenizer
        return ReplicatedLLM(self.handle, self.hub, info=info,
                             tokenizer=load_tokenizer(self.engine_config.model),
                             max_model_len=first["max_model_len"],
                             max_cached_contents_per_tenant=self.engine_config.max_cached_contents_per_tenant)

    def stop(self) -> None:
        try:
            serve.delete(self.config.app_name)
            if self.hub is not None:
                ray.kill(self.hub)
            if self._owns_cluster:
                serve.shutdown()
        finally:
            if self._owns_cluster:
                ray.shutdown()
