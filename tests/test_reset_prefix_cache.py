"""``POST /reset_prefix_cache`` (vLLM's) through the real server: off unless the operator starts it
with ``--enable-reset-prefix-cache`` (403, whatever the key, so that under ``--cache-isolation
api-key`` no tenant can empty the others' cache), behind the API key (401), refused while a request
runs (409 in OpenAI's error shape), and otherwise every tenant's cached prefixes are gone and a KV
event subscriber sees ``AllBlocksCleared``; vLLM's query parameters (400 naming one we do not do).
The engine steps in its own process (the core's ``reset_prefix_cache`` utility)."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
from test_kv_events import AllBlocksCleared, Subscriber

from prefixkv import LLM
from prefixkv.async_engine import AsyncEngine
from prefixkv.config import CacheConfig, EngineConfig, KVEventsConfig, SchedulerConfig
from prefixkv.engine_core.client import EngineCoreClient
from prefixkv.server.app import BackgroundServer, ServerConfig

KEYS = ("reset-key-a", "reset-key-b")
TOPIC = "kv"
PROMPT = [7 + i % 200 for i in range(41)]  # 10 full blocks of 4


@pytest.fixture(scope="module")
def sockets():
    d = tempfile.mkdtemp(prefix="kvrs", dir="/tmp")  # (ipc:// paths are limited to about 100 characters)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def server(tiny_llama, sockets):
    events = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{sockets}/pub",
                            replay_endpoint=f"ipc://{sockets}/replay", topic=TOPIC)
    config = EngineConfig(model=str(tiny_llama), dtype="float64", cache=CacheConfig(block_size=4, num_kv_blocks=256),
                          scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8), kv_events=events)
    core = EngineCoreClient.launch(config)
    sub = Subscriber(SimpleNamespace(endpoint=events.endpoint, replay_endpoint=events.replay_endpoint), TOPIC)
    try:
        with BackgroundServer(core, ServerConfig("tiny", api_key=KEYS[0], api_keys=KEYS[1:],
                                                 cache_isolation="api-key", enable_reset_prefix_cache=True)) as srv:
            srv.core, srv.sub = core, sub
            yield srv
    finally:
        sub.close()
        core.close()


def _post(srv, path: str, body: dict | None = None, key: str | None = KEYS[0]) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(srv.url + path, json.dumps(body or {}).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _cached(srv, key: str) -> int:
    status, out = _post(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}, key)
    assert status == 200, out
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def _wait_idle(core) -> None:
    deadline = time.monotonic() + 30
    while True:
        s = core.stats()
        if s["num_running"] == 0 and s["num_waiting"] == 0:
            return
        assert time.monotonic() < deadline, s
        time.sleep(0.05)


def test_reset_empties_every_tenants_cache_and_publishes_all_blocks_cleared(server):
    for key in KEYS:
        _cached(server, key)
        assert _cached(server, key) == 40
    status, out = _post(server, "/reset_prefix_cache", key=KEYS[1])
    assert (status, out) == (200, {"success": True})
    assert [_cached(server, key) for key in KEYS] == [0, 0]  # the other tenant's too: why it is opt-in
    frames = server.sub.request_replay(0)[:-1]
    events = [e for f in frames for e in server.sub.decoder.decode(f[2]).events]
    cleared = [i for i, e in enumerate(events) if isinstance(e, AllBlocksCleared)]
    assert len(cleared) == 1 and events[cleared[0] + 1:], "stored again after the reset"


def test_the_reset_needs_a_key(server):
    status, out = _post(server, "/reset_prefix_cache", key=None)
    assert status == 401 and out["error"]["code"] == "invalid_api_key"
    status, out = _post(server, "/reset_prefix_cache", key="not-a-key")
    assert status == 401


def test_the_reset_is_refused_while_a_request_runs(server):
    req = urllib.request.Request(server.url + "/v1/completions", json.dumps(
        {"prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "temperature": 0, "stream": True}).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {KEYS[0]}"})
    with urllib.request.urlopen(req, timeout=60) as stream:
        assert stream.readline().startswith(b"data: ")  # running
        status, out = _post(server, "/reset_prefix_cache")
    assert status == 409, out
    err = out["error"]
    assert err["code"] == "requests_running" and err["type"] == "invalid_request_error" and err["param"] is None
    assert "no request runs" in err["message"]
    _wait_idle(server.core)  # the stream closed: its request is aborted
    assert _post(server, "/reset_prefix_cache") == (200, {"success": True})


@pytest.mark.parametrize("query, status, param", [
    ("?reset_running_requests=true", 400, "reset_running_requests"),
    ("?drop=1", 400, "drop"),
    ("?reset_external=maybe", 400, "reset_external"),
    ("?reset_running_requests=false&reset_external=true", 200, None),
])
def test_vllms_query_parameters(server, query, status, param):
    got, out = _post(server, "/reset_prefix_cache" + query)
    assert got == status, out
    if param is not None:
        assert out["error"]["param"] == param and param in out["error"]["message"]


def test_off_unless_the_operator_enables_it(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float64", num_kv_blocks=64, block_size=4)
    engine = AsyncEngine(llm.engine)
    try:
        with BackgroundServer(engine, ServerConfig("tiny", api_key=KEYS[0], api_keys=KEYS[1:],
                                                   cache_isolation="api-key")) as srv:
            _cached(srv, KEYS[0])
            status, out = _post(srv, "/reset_prefix_cache", key=KEYS[1])
            assert status == 403, out
            assert out["error"]["type"] == "permission_error" and out["error"]["code"] == "reset_prefix_cache_disabled"
            assert "--enable-reset-prefix-cache" in out["error"]["message"]
            assert _cached(srv, KEYS[0]) == 40  # nothing was reset
            assert _post(srv, "/reset_prefix_cache", key=None)[0] == 401
    finally:
        engine.close()


def test_the_cli_flag(monkeypatch):
    from prefixkv.cli import build_parser, main, server_config_from_args

    args = build_parser().parse_args(["serve", "--enable-reset-prefix-cache"])
    assert server_config_from_args(args).enable_reset_prefix_cache
    assert not server_config_from_args(build_parser().parse_args(["serve"])).enable_reset_prefix_cache
    pytest.importorskip("ray.serve")
    import prefixkv.serve.app as serve_app

    started = []  # with --replicas too: the ingress serves it (every replica resets)
    monkeypatch.setattr(serve_app, "run_ray_server", lambda args, engine, server: started.append(server) or 0)
    assert main(["serve", "--replicas", "2", "--enable-reset-prefix-cache"]) == 0
    assert started[0].enable_reset_prefix_cache
