"""Prometheus metrics, named after vLLM's with the `prefixserve:` prefix.

Engine counters and gauges are read from the engine's latest stats snapshot
at scrape time by a custom collector; per-request latencies are histograms
fed as outputs arrive. Everything lives in one CollectorRegistry per app.

Per-tenant series (`prefixserve:tenant_*`, label `tenant`) exist only with a keys file, and
their label values only ever come from it: a tenant the keys file does not name (none can send
a request) gets no series, so no request can make the server grow a label.
"""
from __future__ import annotations

import time
from typing import Callable, Iterator, Literal, Optional, get_args

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prefixserve.engine.outputs import EngineStats, RequestOutput

P = "prefixserve:"
# What a response store failure was counted in: storing a response, reading one (a
# previous_response_id, a GET, the input items) or deleting one.
StoreOperation = Literal["write", "read", "delete"]

# Seconds; like vLLM's buckets, fine at the low end where a prefix hit lands.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 10.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


class EngineStatsCollector(Collector):
    """Turns the engine's stats snapshot into metric families on every scrape."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str,
                 tenants: frozenset[str] = frozenset()) -> None:
        self._stats = stats
        self._model = model_name
        self._tenants = tenants

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(P + name, doc, labels=["model_name"])
        family.add_metric([self._model], value)
        return family

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(P + name, doc, labels=["model_name"])
        family.add_metric([self._model], value)
        return family

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield self._counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                            s.prefix_cache_queries)
        yield self._counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                            s.prefix_cache_hits)
        yield self._counter("prompt_tokens", "Prompt tokens of scheduled requests.", s.prompt_tokens)
        yield self._counter("computed_prompt_tokens", "Prompt tokens actually prefilled.",
                            s.computed_prompt_tokens)
        yield self._counter("generation_tokens", "Generated tokens.", s.generated_tokens)
        yield self._counter("num_preemptions", "Requests preempted for lack of KV blocks.",
                            s.preemptions)
        yield self._counter("kv_evictions", "Cached KV blocks evicted for reuse.", s.evictions)
        yield self._counter("engine_steps", "Engine steps run.", s.steps)
        yield self._counter("encoder_runs", "Images the vision tower encoded.", s.encoder_runs)
        yield self._counter("encoder_cache_hits", "Images whose vision-tower output came from the encoder cache.",
                            s.encoder_cache_hits)
        yield self._gauge("num_requests_running", "Requests in the running batch.", s.num_running)
        yield self._gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield self._gauge("kv_blocks_total", "KV blocks in the pool.", s.blocks_total)
        yield self._gauge("kv_blocks_in_use", "KV blocks referenced by requests.", s.blocks_in_use)
        yield self._gauge("kv_blocks_cached", "Free KV blocks that still hold a reusable prefix.",
                          s.blocks_cached)
        yield self._gauge("kv_blocks_free", "Free KV blocks holding nothing reusable.",
                          s.blocks_free)
        yield self._gauge("kv_blocks_pinned", "KV blocks protected by a pin.", s.blocks_pinned)
        yield self._gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).",
                          s.blocks_in_use / s.blocks_total if s.blocks_total else 0.0)
        yield self._gauge("kv_cache_bytes", "Bytes of the preallocated KV pool.", s.kv_cache_bytes)
        yield self._gauge("weights_bytes", "Bytes of the model's parameters and buffers, each storage once.",
                          s.weights_bytes)
        if s.kv_stores:
            yield from self._kv_store_families(s.kv_stores)
        tenants = [t for t in s.tenants if t.tenant in self._tenants]
        if tenants:
            yield from self._tenant_families(tenants)

    def _tenant_families(self, tenants) -> Iterator[Metric]:
        labels = ["model_name", "tenant"]
        gauges = (("requests_waiting", "The tenant's requests waiting to be scheduled.", "num_waiting"),
                  ("requests_running", "The tenant's requests in the running batch.", "num_running"))
        counters = (("tokens_served", "Prompt tokens computed and output tokens generated for the tenant.",
                     "tokens_served"),
                    ("prefix_cache_queries", "Prompt tokens of the tenant's admitted requests.", "prompt_tokens"),
                    ("prefix_cache_hits", "Of those, tokens found in the prefix cache.", "cached_prompt_tokens"),
                    ("kv_evictions", "The tenant's cached KV blocks evicted (for anyone's miss).", "evictions"))
        for name, doc, attr in gauges:
            gauge = GaugeMetricFamily(P + "tenant_" + name, doc, labels=labels)
            for t in tenants:
                gauge.add_metric([self._model, t.tenant], getattr(t, attr))
            yield gauge
        for name, doc, attr in counters:
            counter = CounterMetricFamily(P + "tenant_" + name, doc, labels=labels)
            for t in tenants:
                counter.add_metric([self._model, t.tenant], getattr(t, attr))
            yield counter
        rate = GaugeMetricFamily(P + "tenant_prefix_cache_hit_rate",
                                 "Share of the tenant's prompt tokens found in the prefix cache (0-1).",
                                 labels=labels)
        for t in tenants:
            rate.add_metric([self._model, t.tenant],
                            t.cached_prompt_tokens / t.prompt_tokens if t.prompt_tokens else 0.0)
        yield rate

    def _kv_store_families(self, stores) -> Iterator[Metric]:
        """One series per KV store (labelled by its URL without credentials)."""
        counters = (("hits", "KV blocks loaded from the store into the pool."),
                    ("misses", "KV blocks asked of the store that it could not serve."),
                    ("bytes_read", "Bytes read from the store."),
                    ("bytes_written", "Bytes written to the store."),
                    ("load_seconds", "Seconds spent reading and verifying blocks from the store."),
                    ("dropped_writes", "KV blocks not written: the writer's queue was full."),
                    ("rejected", "Records refused: corrupt, truncated, stale or of another format."),
                    ("forged", "Records refused because their MAC did not verify (a store with a MAC key)."),
                    ("errors", "Store faults: unreachable, I/O errors, disk full."))
        for name, doc in counters:
            family = CounterMetricFamily(P + "kv_store_" + name, doc, labels=["model_name", "store"])
            for st in stores:
                family.add_metric([self._model, st.store], getattr(st, name))
            yield family
        for name, doc in (("records", "Records the store holds."),
                          ("bytes_held", "Bytes the store holds.")):
            family = GaugeMetricFamily(P + "kv_store_" + name, doc, labels=["model_name", "store"])
            for st in stores:
                if getattr(st, name) >= 0:   # -1: not counted (a remote store)
                    family.add_metric([self._model, st.store], getattr(st, name))
            yield family


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats], model_name: str,
                 tenants: frozenset[str] = frozenset()) -> None:
        """tenants: the keys file's (the only label values the per-tenant series take)."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.tenants = tenants
        self.registry.register(EngineStatsCollector(stats, model_name, tenants))
        labels = ["model_name"]
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=_TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram(P + "inter_token_latency_seconds",
                             "Time between consecutive output tokens.", labels,
                             buckets=_ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to finish.", labels,
                             buckets=_E2E_BUCKETS, registry=self.registry).labels(model_name)
        self._success = Counter(P + "request_success", "Finished requests by finish reason.",
                                labels + ["finished_reason"], registry=self.registry)
        self._refused = Counter(P + "tenant_requests_refused",
                                "The tenant's requests answered 429 (its queue share or its key's token rate).",
                                labels + ["tenant"], registry=self.registry)
        for tenant in sorted(tenants):
            self._refused.labels(model_name, tenant)   # every tenant's series from the start, at 0
        self._store_errors = Counter(
            P + "response_store_errors",
            "Response store failures by operation: write, a response answered but not stored; read "
            "and delete, a request answered 503 because the store was unreachable.",
            labels + ["operation"], registry=self.registry)
        for operation in get_args(StoreOperation):
            self._store_errors.labels(model_name, operation)   # each series from the start, at 0

    def recorder(self) -> RequestRecorder:
        return RequestRecorder(self)

    def finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def response_store_failed(self, operation: StoreOperation) -> None:
        """The response store failed a write (a response answered but not kept) or, unreachable,
        a read or a delete (the request answered 503)."""
        self._store_errors.labels(self.model_name, operation).inc()

    def refused(self, tenant: Optional[str]) -> None:
        """A request of tenant's was answered 429."""
        if tenant in self.tenants:
            self._refused.labels(self.model_name, tenant).inc()


class RequestRecorder:
    """Feeds one engine request's outputs into the latency histograms."""

    def __init__(self, metrics: ServerMetrics, clock: Callable[[], float] = time.monotonic) -> None:
        self._metrics = metrics
        self._clock = clock
        self._tokens = 0
        self._last_token_time: Optional[float] = None
        self._done = False

    def aborted(self, samples: int) -> None:
        """The request was aborted before it finished (its client left): counted as "abort"."""
        if not self._done:
            self._done = True
            for _ in range(samples):
                self._metrics.finished("abort")

    def observe(self, output: RequestOutput) -> None:
        tokens = len(output.outputs[0].token_ids) if output.outputs else 0
        new = tokens - self._tokens
        if new > 0:
            now = self._clock()
            if self._last_token_time is None:
                ttft = output.metrics.time_to_first_token
                if ttft is not None:
                    self._metrics.ttft.observe(ttft)
            else:
                # Outputs are cumulative, so a late reader sees several tokens at once.
                gap = (now - self._last_token_time) / new
                for _ in range(new):
                    self._metrics.itl.observe(gap)
            self._tokens, self._last_token_time = tokens, now
        if output.finished:
            self._done = True
            e2e = output.metrics.e2e_latency
            if e2e is not None:
                self._metrics.e2e.observe(e2e)
            for completion in output.outputs:
                self._metrics.finished(completion.finish_reason or "abort")
