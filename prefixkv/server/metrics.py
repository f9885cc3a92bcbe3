"""Prometheus metrics of one server app, in its own ``CollectorRegistry`` (never the global one, so
several apps can live in one process).

Request-side metrics (counts, latencies) are recorded by the app; engine-side ones (running and
waiting requests, KV blocks, prefix-cache tokens, preemptions) are read at scrape time from
``AsyncEngine.stats()``, a snapshot the engine thread refreshes every step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)

# (stats key, metric name, help, kind)
_ENGINE_METRICS = (
    ("num_running", "prefixkv_num_requests_running", "Requests in the running batch.", "gauge"),
    ("num_waiting", "prefixkv_num_requests_waiting", "Requests waiting for admission.", "gauge"),
    ("num_kv_blocks_used", "prefixkv_kv_blocks_used", "KV blocks held by requests.", "gauge"),
    ("num_kv_blocks", "prefixkv_kv_blocks_total", "KV blocks in the pool.", "gauge"),
    ("num_kv_blocks_evictable", "prefixkv_kv_blocks_evictable",
     "KV blocks only the prefix cache holds: they keep a cached prefix and are reclaimable.", "gauge"),
    ("prefix_queried_tokens", "prefixkv_prefix_cache_queried_tokens",
     "Prompt tokens looked up in the prefix cache.", "counter"),
    ("prefix_hit_tokens", "prefixkv_prefix_cache_hit_tokens",
     "Prompt tokens found in the prefix cache.", "counter"),
    ("num_preemptions", "prefixkv_preemptions", "Requests preempted (recomputed later).", "counter"),
    ("spec_draft_tokens", "prefixkv_spec_draft_tokens", "Speculative draft tokens proposed.", "counter"),
    ("spec_accepted_tokens", "prefixkv_spec_accepted_tokens",
     "Speculative draft tokens accepted (equal to greedy decoding's).", "counter"),
)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for key, name, doc, kind in _ENGINE_METRICS:
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            yield family(name, doc, value=float(stats.get(key, 0)))

    def describe(self) -> Iterator[Metric]:
        return iter(())


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("prefixkv_http_requests", "HTTP requests by route and status code.",
                                ["route", "status"], registry=r)
        self.time_to_first_token = Histogram("prefixkv_time_to_first_token_seconds",
                                             "From request arrival to the first generated token.",
                                             buckets=_LATENCY_BUCKETS, registry=r)
        self.time_per_output_token = Histogram("prefixkv_time_per_output_token_seconds",
                                               "Mean time between output tokens after the first, per request.",
                                               buckets=_TPOT_BUCKETS, registry=r)
        self.e2e_latency = Histogram("prefixkv_e2e_request_latency_seconds",
                                     "From request arrival to its last token.", buckets=_LATENCY_BUCKETS,
                                     registry=r)
        self.prompt_tokens = Counter("prefixkv_prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=r)
        self.generation_tokens = Counter("prefixkv_generation_tokens", "Generated tokens of finished requests.",
                                         registry=r)
        r.register(_EngineCollector(stats))

    def observe_request(self, ttft: float | None, e2e: float, num_prompt_tokens: int, num_output_tokens: int,
                        num_decode_steps: int) -> None:
        """One finished request: ``num_output_tokens`` counts the tokens of all its choices,
        ``num_decode_steps`` those of its longest choice (choices decode side by side)."""
        if ttft is not None:
            self.time_to_first_token.observe(ttft)
            if num_decode_steps > 1:
                self.time_per_output_token.observe((e2e - ttft) / (num_decode_steps - 1))
        self.e2e_latency.observe(e2e)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_output_tokens)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
