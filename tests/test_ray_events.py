"""The router fed by the replicas' KV events (``--routing-cache-view events``) on Ray Serve: each
replica publishes on its own endpoints, the router's view of each follows them, and a repeated
long prefix goes back to the replica that holds it. One local Ray instance, two replicas of the
tiny float64 Llama; digests every 2 s (the events, not the digests, show the prefix first)."""

from __future__ import annotations

import random

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from prefixkv.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from test_ray_routing import serve_two_replicas  # noqa: E402
from test_ray_serve import _complete, _health, _metrics, _per_replica, _tokens, _wait  # noqa: E402


@pytest.fixture(scope="module")
def app(one_ray_instance, tiny_llama):
    cfg = EngineConfig(model=str(tiny_llama), dtype="float64", cache=CacheConfig(block_size=4, num_kv_blocks=256),
                       scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8))
    yield from serve_two_replicas(cfg, routing_stats_period_s=2.0, routing_cache_view="events")


def _views(url: str) -> dict[str, dict]:
    return {rid: r.get("cache_view") for rid, r in _health(url)["replicas"].items()}


def test_a_repeated_prefix_goes_back_to_the_replica_whose_events_show_it(app):
    url = app
    replicas = _health(url)["replicas"]
    endpoints = [(r["kv_events"]["endpoint"], r["kv_events"]["replay_endpoint"]) for r in replicas.values()]
    assert len(set(endpoints)) == 2 and all(e.startswith("tcp://") for pair in endpoints for e in pair)
    rng = random.Random(3)
    p = _tokens(rng, 48)  # 12 blocks
    _wait(lambda: all(v and v["synced"] for v in _views(url).values()), 30, "the router's event views")
    assert _complete(url, p + _tokens(rng, 3))["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    (ra,) = [rid for rid, n in _per_replica(_metrics(url), "prefixkv_replica_routed_requests_total").items() if n]
    _wait(lambda: _views(url)[ra]["num_blocks"] >= 12, 30, "the prefix's stored events")
    for _ in range(3):
        assert _complete(url, p + _tokens(rng, 3))["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    m = _metrics(url)
    routed = _per_replica(m, "prefixkv_replica_routed_requests_total")
    assert routed[ra] == 4 and sum(routed.values()) == 4
    assert m['prefixkv_router_decisions_total{reason="prefix"}'] == 3
    assert all(v["num_lost"] == 0 for v in _views(url).values())
