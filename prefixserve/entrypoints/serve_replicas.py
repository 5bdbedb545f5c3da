"""`prefixserve serve` flags of the replicated service (no Ray imported here: the single-process
server must not pay for it)."""
from __future__ import annotations

import argparse

from prefixserve.replicas.policy import ROUTERS, RoutingConfig

_DEFAULTS = RoutingConfig()


def add_replica_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replicas (Ray Serve)")
    g.add_argument("--replicas", type=int, default=1,
                   help="engine replicas, deployed as a Ray Serve application behind a "
                        "prefix-aware router (default: %(default)s, one engine in this process)")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. ray://head:10001 or auto); default: start a "
                        "local one and stop it with the server")
    g.add_argument("--router", choices=ROUTERS, default=_DEFAULTS.router,
                   help="how requests are spread over the replicas (default: %(default)s)")
    g.add_argument("--balance-abs", type=int, default=_DEFAULTS.balance_abs,
                   help="prefix-aware: requests in flight by which the prefix holder must exceed "
                        "the least loaded replica (and --balance-rel) before load wins "
                        "(default: %(default)s)")
    g.add_argument("--balance-rel", type=float, default=_DEFAULTS.balance_rel,
                   help="prefix-aware: ... and the ratio of their loads (default: %(default)s)")
    g.add_argument("--router-index-capacity", type=int, default=_DEFAULTS.index_capacity,
                   help="block hashes the router remembers over all replicas "
                        "(default: %(default)s)")
    g.add_argument("--replica-cpus", type=float, default=1.0,
                   help="CPUs reserved for each replica, also its thread count "
                        "(default: %(default)s)")


def wants_replicas(args: argparse.Namespace) -> bool:
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    return args.replicas > 1 or args.ray_address is not None


def run_replicated(args: argparse.Namespace, engine_config, server_config) -> int:
    """Serves the HTTP API from this process over the engine replicas; stops them on exit."""
    import uvicorn

    from prefixserve.entrypoints.server.app import build_app
    from prefixserve.replicas.metrics import install_routing_metrics
    from prefixserve.replicas.service import ReplicaConfig, ReplicaService

    replica_config = ReplicaConfig(
        num_replicas=args.replicas, ray_address=args.ray_address, replica_cpus=args.replica_cpus,
        routing=RoutingConfig(router=args.router, balance_abs=args.balance_abs,
                              balance_rel=args.balance_rel,
                              index_capacity=args.router_index_capacity))
    service = ReplicaService(engine_config, replica_config, max_waiting=server_config.max_waiting)
    try:
        front = service.start()
        app = build_app(front, server_config)
        install_routing_metrics(app, front)
        uvicorn.run(app, host=server_config.host, port=server_config.port,
                    log_level=args.log_level)
    finally:
        service.stop()
    return 0
