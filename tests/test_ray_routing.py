"""Bursts on Ray Serve (issue 43): requests sent at the same moment to ``--replicas 2`` run half on
each replica, by the replicas' own running counts (``prefixkv_replica_num_requests_running`` in the
ingress's /metrics, as each replica publishes it), whether they share nothing or only a short
system prompt. One local Ray instance, two replicas of the tiny float64 Llama (fresh: their first
requests), the default router."""

from __future__ import annotations

import json
import random
import socket
import threading
import urllib.request

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from prefixkv.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from prefixkv.server.serving import ServerConfig  # noqa: E402
from test_ray_serve import MODEL, _health, _metrics, _per_replica, _wait  # noqa: E402

PERIOD = 0.1  # the replicas publish their load this often
OUTPUT = 400  # tokens per request: long enough that all run at once for a while


def serve_two_replicas(cfg: EngineConfig, **build_kwargs):
    """A local Ray instance serving two replicas of ``cfg``: yields the ingress's URL once both
    publish, then shuts everything down."""
    from prefixkv.serve import build_app

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(cfg, ServerConfig(MODEL), num_replicas=2, **build_kwargs), name="prefixkv", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    _wait(lambda: len(_health(url)["replicas"]) == 2, 60, "two replicas publishing")
    yield url
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def app(one_ray_instance, tiny_llama):
    cfg = EngineConfig(model=str(tiny_llama), dtype="float64", cache=CacheConfig(block_size=4, num_kv_blocks=1024),
                       scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16))
    yield from serve_two_replicas(cfg, routing_stats_period_s=PERIOD)


def _now(url: str, metric: str) -> dict[str, float]:
    return _per_replica(_metrics(url), metric)


def _burst(url: str, path: str, bodies: list[dict]) -> tuple[dict[str, float], list[bytes]]:
    """Sends every body at the same moment (streams), waits until the replicas report all of them
    running, and returns those running counts and each stream's whole body."""
    start = threading.Barrier(len(bodies))
    streams: list[bytes] = [b""] * len(bodies)
    errors: list[BaseException] = []

    def send(i: int) -> None:
        req = urllib.request.Request(url + path, json.dumps({**bodies[i], "stream": True}).encode(),
                                     {"Content-Type": "application/json"})
        try:
            start.wait()
            with urllib.request.urlopen(req, timeout=120) as resp:
                streams[i] = resp.read()
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    seen: list[dict[str, float]] = []

    def all_running() -> bool:
        seen.append(_now(url, "prefixkv_replica_num_requests_running"))
        return sum(seen[-1].values()) == len(bodies)

    _wait(all_running, 60, "every request of the burst running")
    for t in threads:
        t.join(120)
    assert not errors, errors
    return seen[-1], streams


def test_a_burst_runs_half_on_each_replica(app):
    url = app
    rng = random.Random(43)
    routed0 = _now(url, "prefixkv_replica_routed_requests_total")
    # 8 completions with distinct random token prompts: nothing shared
    unrelated = [{"model": MODEL, "prompt": [rng.randrange(3, 300) for _ in range(24)], "max_tokens": OUTPUT,
                  "temperature": 0, "ignore_eos": True} for _ in range(8)]
    running, streams = _burst(url, "/v1/completions", unrelated)
    assert sorted(running.values()) == [4.0, 4.0], running
    assert all(s.rstrip().endswith(b"data: [DONE]") and b'"error"' not in s for s in streams)
    routed = _now(url, "prefixkv_replica_routed_requests_total")
    assert {rid: routed[rid] - routed0.get(rid, 0) for rid in routed} == dict.fromkeys(running, 4.0)
    # 8 chats sharing only a short system prompt (the chat template's few blocks), distinct questions
    system = {"role": "system", "content": "You are a helpful assistant."}
    chats = [{"model": MODEL, "messages": [system, {"role": "user", "content": f"question {i}: {rng.random()}"}],
              "max_tokens": OUTPUT, "temperature": 0, "ignore_eos": True} for i in range(8)]
    running, streams = _burst(url, "/v1/chat/completions", chats)
    assert sorted(running.values()) == [4.0, 4.0], running
    assert all(s.rstrip().endswith(b"data: [DONE]") and b'"error"' not in s for s in streams)
    # every request ended: the router counts none against the replicas any more
    assert set(_now(url, "prefixkv_replica_router_in_flight").values()) == {0.0}
