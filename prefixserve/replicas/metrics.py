"""Routing metrics on the server's /metrics, next to the engines' own (summed) metrics:
decisions by reason, and per replica the requests routed, the blocks the router believes it
holds, its requests in flight and its own prefix-cache hit rate."""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from prefixserve.replicas.front import ReplicatedLLM


class RoutingCollector(Collector):
    def __init__(self, front: ReplicatedLLM) -> None:
        self.front = front

    def collect(self):
        routers = self.front.last_routing()
        decisions = CounterMetricFamily("prefixserve:router_decisions", "routing decisions by reason",
                                        labels=["reason"])
        routed = CounterMetricFamily("prefixserve:replica_requests_routed",
                                     "requests the routers sent to each replica", labels=["replica"])
        held = GaugeMetricFamily("prefixserve:router_index_blocks",
                                 "block hashes the routers believe each replica holds",
                                 labels=["replica"])
        reasons, per_routed, per_held = {}, {}, {}
        for view in routers.values():
            for key, into in (("reasons", reasons), ("routed", per_routed), ("held", per_held)):
                for name, value in view.get(key, {}).items():
                    into[name] = into.get(name, 0) + value
        for reason, value in sorted(reasons.items()):
            decisions.add_metric([reason], value)
        for replica, value in sorted(per_routed.items()):
            routed.add_metric([replica], value)
        for replica, value in sorted(per_held.items()):
            held.add_metric([replica], value)
        running = GaugeMetricFamily("prefixserve:replica_requests_in_flight",
                                    "requests running or waiting in each replica's engine",
                                    labels=["replica"])
        hit_rate = GaugeMetricFamily("prefixserve:replica_prefix_cache_hit_rate",
                                     "cached prompt tokens over prompt tokens, per replica",
                                     labels=["replica"])
        for replica, stats in sorted(self.front.replica_stats().items()):
            running.add_metric([replica], stats.get("num_running", 0) + stats.get("num_waiting", 0))
            prompt = stats.get("prompt_tokens", 0)
            hit_rate.add_metric([replica], stats.get("cached_prompt_tokens", 0) / prompt if prompt else 0.0)
        yield from (decisions, routed, held, running, hit_rate)


def install_routing_metrics(app, front: ReplicatedLLM) -> None:
    """Adds the routing metrics to the registry the app's /metrics serves."""
    app.state.server.metrics.registry.register(RoutingCollector(front))
