"""Prometheus metrics of one server app, in its own ``CollectorRegistry`` (never the global one, so
several apps can live in one process).

Beside our own ``prefixkv_*`` names, the ``vllm:*`` names vLLM's Grafana dashboards read, with the
``model_name`` label: ``vllm:num_requests_running`` / ``_waiting``, ``vllm:kv_cache_usage_perc``
(0-1), ``vllm:prefix_cache_queries`` / ``_hits`` (tokens), ``vllm:num_preemptions``,
``vllm:prompt_tokens`` / ``vllm:generation_tokens``, ``vllm:request_success`` (by
``finished_reason``) and the ``vllm:time_to_first_token_seconds``,
``vllm:inter_token_latency_seconds`` and ``vllm:e2e_request_latency_seconds`` histograms.

Request-side metrics (counts, latencies) are recorded by the app; engine-side ones (running and
waiting requests, KV blocks, prefix-cache tokens, preemptions) are read at scrape time from
``AsyncEngine.stats()``, a snapshot the engine thread refreshes every step.
"""

from __future__ import annotations

import os
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
    ("num_kv_blocks_retained", "prefixkv_kv_blocks_retained",
     "KV blocks of prefixes requests asked to retain (kv_retention, cache_control), cached or not.", "gauge"),
    ("retention_lapsed", "prefixkv_retention_lapsed",
     "Retained prefixes let go before their TTL to keep --max-retained-fraction (the least recently used first).",
     "counter"),
    ("retention_expired", "prefixkv_retention_expired", "Retained prefixes let go when their TTL passed.",
     "counter"),
    ("retained_blocks_evicted", "prefixkv_kv_retained_blocks_evicted",
     "Retained KV blocks evicted from the device pool (to the host tier, if any) or pushed out of the host tier "
     "because a request needed the room.", "counter"),
    ("num_preemptions", "prefixkv_preemptions", "Requests preempted (recomputed later).", "counter"),
    ("num_requests_aborted", "prefixkv_requests_aborted",
     "Requests aborted before they finished (client gone, timeout, shutdown).", "counter"),
    ("num_host_blocks", "prefixkv_kv_host_blocks_total", "Slots of the host-memory KV tier.", "gauge"),
    ("num_host_blocks_used", "prefixkv_kv_host_blocks_used", "Host-tier slots holding a block.", "gauge"),
    ("prefix_host_hit_tokens", "prefixkv_prefix_cache_host_hit_tokens",
     "Prompt tokens found in the host-memory or disk tier (part of prefix_cache_hit_tokens).", "counter"),
    ("host_blocks_stored", "prefixkv_kv_host_blocks_stored", "Blocks copied from the device to the host tier.",
     "counter"),
    ("host_blocks_loaded", "prefixkv_kv_host_blocks_loaded", "Blocks copied from the host tier back to the device.",
     "counter"),
    ("num_disk_blocks", "prefixkv_kv_disk_blocks_total", "Blocks the disk tier may hold.", "gauge"),
    ("num_disk_blocks_used", "prefixkv_kv_disk_blocks_used", "Blocks with a file in the disk tier.", "gauge"),
    ("disk_bytes_written", "prefixkv_kv_disk_bytes_written", "KV bytes written to the disk tier.", "counter"),
    ("disk_bytes_read", "prefixkv_kv_disk_bytes_read", "KV bytes read back from the disk tier.", "counter"),
    ("disk_files_discarded", "prefixkv_kv_disk_files_discarded",
     "Disk-tier files found invalid (at start, or when prefetched: corrupt, truncated, foreign) and deleted.",
     "counter"),
    ("disk_blocks_prefetched", "prefixkv_kv_disk_blocks_prefetched",
     "Disk-tier blocks read into memory by the reader thread before their request was admitted.", "counter"),
    ("disk_sync_reads", "prefixkv_kv_disk_sync_reads",
     "Disk-tier blocks the engine step read itself (not prefetched).", "counter"),
    ("disk_admission_waits", "prefixkv_kv_disk_admission_waits",
     "Times a waiting request's admission was put off while its blocks were read from disk.", "counter"),
    ("disk_wait_admissions", "prefixkv_kv_disk_wait_admissions",
     "Waiting requests whose disk reads ended within a scheduling pass's bounded wait (admitted in that step "
     "unless KV blocks ran short).", "counter"),
    ("disk_wait_s", "prefixkv_kv_disk_wait_seconds",
     "Seconds scheduling passes waited (within their bound) for disk reads.", "counter"),
    ("deferred_promotions", "prefixkv_kv_deferred_promotions",
     "Requests admitted with blocks from a lower tier whose first step waited for the copies (CUDA side stream).",
     "counter"),
    ("async_promoted_blocks", "prefixkv_kv_async_promoted_blocks",
     "Blocks copied back into the device on the side stream, beside a forward pass.", "counter"),
    ("spec_draft_tokens", "prefixkv_spec_draft_tokens", "Speculative draft tokens proposed.", "counter"),
    ("spec_accepted_tokens", "prefixkv_spec_accepted_tokens",
     "Speculative draft tokens accepted (equal to greedy decoding's).", "counter"),
    ("num_prefill_tokens", "prefixkv_engine_prefill_tokens",
     "Prompt tokens the engine's steps computed (prefix-cache hits are not computed).", "counter"),
    ("prefill_s", "prefixkv_engine_prefill_step_seconds",
     "Seconds of the engine steps that computed prompt tokens (with the decode tokens batched beside them).",
     "counter"),
    ("num_decode_steps", "prefixkv_engine_decode_steps", "Engine steps that computed decode tokens only.",
     "counter"),
    ("decode_s", "prefixkv_engine_decode_step_seconds", "Seconds of the decode-only engine steps.", "counter"),
    ("num_decode_step_seqs", "prefixkv_engine_decode_step_sequences",
     "Sequences of the decode-only engine steps (over prefixkv_engine_decode_steps: their mean batch).", "counter"),
    ("num_decode_step_context_tokens", "prefixkv_engine_decode_step_context_tokens",
     "Tokens of context the sequences of the decode-only engine steps attended to, their new tokens included "
     "(over prefixkv_engine_decode_step_sequences: the mean context).", "counter"),
    ("num_prefill_step_decodes", "prefixkv_engine_prefill_step_decode_sequences",
     "Sequences decoding in the engine steps that also computed prompt tokens.", "counter"),
)

# a stats key's metric name (a counter's samples end in _total)
ENGINE_METRIC_NAMES = {key: name for key, name, _, _ in _ENGINE_METRICS}

# vLLM's names for the same engine statistics: (stats key, name, help, kind)
_VLLM_ENGINE_METRICS = (
    ("num_running", "vllm:num_requests_running", "Number of requests in model execution batches.", "gauge"),
    ("num_waiting", "vllm:num_requests_waiting", "Number of requests waiting to be processed.", "gauge"),
    ("prefix_queried_tokens", "vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", "counter"),
    ("prefix_hit_tokens", "vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", "counter"),
    ("num_preemptions", "vllm:num_preemptions", "Cumulative number of preemptions.", "counter"),
)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, Any]], model_name: str) -> None:
        self._stats = stats
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for key, name, doc, kind in _ENGINE_METRICS:
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            yield family(name, doc, value=float(stats.get(key, 0)))
        for key, name, doc, kind in _VLLM_ENGINE_METRICS:
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc, labels=["model_name"])
            family.add_metric([self._model], float(stats.get(key, 0)))
            yield family
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                  labels=["model_name"])
        total = stats.get("num_kv_blocks", 0)
        usage.add_metric([self._model], stats.get("num_kv_blocks_used", 0) / total if total else 0.0)
        yield usage

    def describe(self) -> Iterator[Metric]:
        return iter(())


class ReplicaCollector(Collector):
    """Behind a Ray Serve ingress (serve/ingress.py): each engine replica's statistics, labelled
    ``replica`` (the unlabelled engine metrics are then their sums), and the router's decisions."""

    def __init__(self, stats_by_replica: Callable[[], dict[str, dict[str, Any]]],
                 decisions: Callable[[], dict[str, int]]) -> None:
        self._stats = stats_by_replica
        self._decisions = decisions

    def collect(self) -> Iterator[Metric]:
        by_replica = self._stats()
        own = (("running", "prefixkv_replica_up", "1 for an engine replica whose engine runs.", "gauge"),
               ("num_cached_blocks", "prefixkv_replica_cached_blocks",
                "Blocks in the replica's last published cache digest (every tier).", "gauge"),
               ("num_routed", "prefixkv_replica_routed_requests", "Requests the router sent to the replica.",
                "counter"),
               ("num_in_flight", "prefixkv_replica_router_in_flight",
                "Requests the router counts against the replica now (from its routing decision until they end).",
                "gauge"),
               ("num_prefill_tokens", "prefixkv_replica_prefill_tokens_pending",
                "Prompt tokens still to compute on the replica (its last published load).", "gauge"),
               ("prefill_tokens_per_s", "prefixkv_replica_prefill_tokens_per_second",
                "The replica's measured prefill rate (0 until measured).", "gauge"),
               ("decode_step_s", "prefixkv_replica_decode_step_seconds",
                "The replica's measured time of a step of decodes only (0 until measured).", "gauge"))
        engine = tuple((key, name.replace("prefixkv_", "prefixkv_replica_", 1), doc, kind)
                       for key, name, doc, kind in _ENGINE_METRICS)
        for key, name, doc, kind in own + engine:
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc, labels=["replica"])
            for rid, stats in sorted(by_replica.items()):
                family.add_metric([rid], float(stats.get(key, 0)))
            yield family
        decisions = CounterMetricFamily("prefixkv_router_decisions",
                                        "Routing decisions by reason (prefix, no_match, imbalanced, ...).",
                                        labels=["reason"])
        for reason, n in sorted(self._decisions().items()):
            decisions.add_metric([reason], float(n))
        yield decisions

    def describe(self) -> Iterator[Metric]:
        return iter(())


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict[str, Any]], model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.model_name = model_name
        label = ["model_name"]
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                   label, buckets=_LATENCY_BUCKETS, registry=r)
        self.vllm_itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                                  label, buckets=_TPOT_BUCKETS, registry=r)
        self.vllm_e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                                  label, buckets=_LATENCY_BUCKETS, registry=r)
        self.vllm_prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", label,
                                          registry=r)
        self.vllm_generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                              label, registry=r)
        self.vllm_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                    label + ["finished_reason"], registry=r)
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
        # per cache partition (``--cache-isolation api-key``): labelled by the key's index, never the key
        self.partition_requests = Counter("prefixkv_partition_requests", "Finished requests per cache partition.",
                                          ["partition"], registry=r)
        self.partition_prompt_tokens = Counter("prefixkv_partition_prompt_tokens",
                                               "Prompt tokens of finished requests per cache partition.",
                                               ["partition"], registry=r)
        self.partition_cached_tokens = Counter("prefixkv_partition_prefix_cache_hit_tokens",
                                               "Prompt tokens found in the prefix cache, per cache partition.",
                                               ["partition"], registry=r)
        self.collectors: list[Collector] = []  # read at scrape time (not the process-local metrics)
        self.register(_EngineCollector(stats, model_name))

    def register(self, collector: Collector) -> None:
        """A collector of figures this process reads at scrape time (the engine's statistics)."""
        self.collectors.append(collector)
        self.registry.register(collector)

    def observe_request(self, ttft: float | None, e2e: float, num_prompt_tokens: int, num_output_tokens: int,
                        num_decode_steps: int, finish_reasons: list[str] = ()) -> None:
        """One finished request: ``num_output_tokens`` counts the tokens of all its choices,
        ``num_decode_steps`` those of its longest choice (choices decode side by side),
        ``finish_reasons`` one per choice."""
        m = self.model_name
        if ttft is not None:
            self.time_to_first_token.observe(ttft)
            self.vllm_ttft.labels(m).observe(ttft)
            if num_decode_steps > 1:
                itl = (e2e - ttft) / (num_decode_steps - 1)
                self.time_per_output_token.observe(itl)
                self.vllm_itl.labels(m).observe(itl)
        self.e2e_latency.observe(e2e)
        self.vllm_e2e.labels(m).observe(e2e)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_output_tokens)
        self.vllm_prompt_tokens.labels(m).inc(num_prompt_tokens)
        self.vllm_generation_tokens.labels(m).inc(num_output_tokens)
        for reason in finish_reasons:
            self.vllm_success.labels(m, reason).inc()

    def observe_partition(self, partition: str, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """One finished request of a cache partition (a label such as ``key0``, never a secret)."""
        self.partition_requests.labels(partition).inc()
        self.partition_prompt_tokens.labels(partition).inc(num_prompt_tokens)
        self.partition_cached_tokens.labels(partition).inc(num_cached_tokens)

    def render(self) -> tuple[bytes, str]:
        """The exposition text. With several HTTP processes (``PROMETHEUS_MULTIPROC_DIR`` set, see
        server/api_servers.py) the request metrics are every process's, summed from their files."""
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        for collector in self.collectors:
            registry.register(collector)
        return generate_latest(registry), CONTENT_TYPE_LATEST
