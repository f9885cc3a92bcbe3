"""prefixkv on Ray Serve, end to end: a two-node Ray cluster on this machine
(``ray.cluster_utils.Cluster``, one CPU per node), two engine replicas of the tiny float64 Llama
(one per node) behind the ingress, driven over HTTP and with the openai client.

The replicas' KV pools are small (64 blocks of 4 tokens) so that a long request evicts a cached
prefix for real. The replicas publish their cache digests every 0.3 s; tests that need the router
to have seen a change wait for two newer digests (``digest_seq`` in the ingress's /health)."""

from __future__ import annotations

import json
import random
import socket
import time
import urllib.error
import urllib.request

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from prefixkv.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from prefixkv.server.serving import ServerConfig  # noqa: E402
from test_lossless import hf_reference  # noqa: E402

MODEL = "tiny-llama"
BLOCK = 4
POOL = 64
PERIOD = 0.3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(one_ray_instance, tiny_llama):
    from ray.cluster_utils import Cluster

    from prefixkv.serve import build_app

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    c.add_node(num_cpus=1)
    ray.init(address=c.address, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    cfg = EngineConfig(model=str(tiny_llama), dtype="float64", cache=CacheConfig(block_size=BLOCK, num_kv_blocks=POOL),
                       scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16))
    serve.run(build_app(cfg, ServerConfig(MODEL, enable_reset_prefix_cache=True), num_replicas=2,
                        routing_stats_period_s=PERIOD,
                        health_check_period_s=1.0), name="prefixkv", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    _wait(lambda: len(_health(url)["replicas"]) == 2, 60, "two replicas publishing digests")
    yield url
    serve.shutdown()
    ray.shutdown()
    c.shutdown()


def _wait(cond, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if cond():
                return
        except (urllib.error.URLError, KeyError, ConnectionError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _health(url: str) -> dict:
    return json.loads(_get(url + "/health")[1])


def _metrics(url: str) -> dict[str, float]:
    out = {}
    for line in _get(url + "/metrics")[1].decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _per_replica(m: dict[str, float], metric: str) -> dict[str, float]:
    out = {}
    for k, v in m.items():
        if k.startswith(metric + "{replica="):
            out[k.split('"')[1]] = v
    return out


def _fresh_digests(url: str) -> None:
    """Until every replica has published two digests after now (the router sees the present)."""
    seqs = {rid: r["digest_seq"] for rid, r in _health(url)["replicas"].items()}
    _wait(lambda: all(r["digest_seq"] >= seqs.get(rid, 0) + 2 for rid, r in _health(url)["replicas"].items()),
          30, "fresh cache digests")


def _complete(url: str, ids: list[int], max_tokens: int = 4) -> dict:
    status, body = _post(url + "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": max_tokens,
                                                   "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    return body


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 200) for _ in range(n)]


def test_routing_follows_the_replicas_real_caches(cluster):
    """First test of the module (fresh replicas): a shared prefix goes where it is cached, another
    prefix goes to the other replica, and once a replica has evicted a prefix the router no longer
    sends it there."""
    url = cluster
    assert {r["cached_blocks"] for r in _health(url)["replicas"].values()} == {0}
    rng = random.Random(7)
    p, q = _tokens(rng, 40), _tokens(rng, 80)

    cached = []
    for i in range(3):
        cached.append(_complete(url, p + _tokens(rng, 5))["usage"]["prompt_tokens_details"]["cached_tokens"])
        _fresh_digests(url)
    assert cached == [0, 40, 40]  # P's 10 blocks, computed once
    m = _metrics(url)
    hits = _per_replica(m, "prefixkv_replica_prefix_cache_hit_tokens_total")
    routed = _per_replica(m, "prefixkv_replica_routed_requests_total")
    (ra,) = [rid for rid, n in routed.items() if n == 3]
    (rb,) = [rid for rid in routed if rid != ra]
    assert hits == {ra: 80.0, rb: 0.0}
    assert m['prefixkv_router_decisions_total{reason="no_match"}'] == 1
    assert m['prefixkv_router_decisions_total{reason="prefix"}'] == 2

    # a new prefix: no replica holds it -> the one caching less (rb)
    assert _complete(url, q + _tokens(rng, 3))["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    _fresh_digests(url)
    assert _per_replica(_metrics(url), "prefixkv_replica_routed_requests_total") == {ra: 3.0, rb: 1.0}

    # ra evicts P for real: a long unrelated prompt (61 of its 64 blocks) lands there (it caches
    # less than rb: 16 blocks against 21), then a second one sharing the first's start takes P's last
    # blocks (the least recently used)
    long1 = _tokens(rng, 240)
    assert _complete(url, long1)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    _fresh_digests(url)
    long2 = long1[:200] + _tokens(rng, 48)
    assert _complete(url, long2)["usage"]["prompt_tokens_details"]["cached_tokens"] == 200
    _fresh_digests(url)
    routed = _per_replica(_metrics(url), "prefixkv_replica_routed_requests_total")
    assert routed == {ra: 5.0, rb: 1.0}

    before = _metrics(url)
    assert _complete(url, p + _tokens(rng, 5))["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    after = _metrics(url)
    assert after['prefixkv_router_decisions_total{reason="no_match"}'] == \
        before['prefixkv_router_decisions_total{reason="no_match"}'] + 1  # not "prefix": the digest said so
    # and it went to the replica caching less, rb
    assert _per_replica(after, "prefixkv_replica_routed_requests_total") == {ra: 5.0, rb: 2.0}


def test_greedy_outputs_equal_transformers_through_the_ingress(cluster, tiny_llama):
    url = cluster
    rng = random.Random(3)
    shared = _tokens(rng, 21)
    prompts = [shared + _tokens(rng, rng.randrange(1, 9)) for _ in range(4)] + [_tokens(rng, 13)]
    refs = hf_reference(tiny_llama, prompts, max_tokens=6)
    for p, ref in zip(prompts, refs):
        status, body = _post(url + "/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 6,
                                                       "temperature": 0, "ignore_eos": True})
        assert status == 200, body
        text = body["choices"][0]["text"]
        status, detok = _post(url + "/detokenize", {"tokens": ref})
        assert status == 200 and text == detok["prompt"], (text, detok)


def test_openai_client_streams_through_the_ingress(cluster):
    client = openai.OpenAI(base_url=cluster + "/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "hello there, general"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content and full.usage.completion_tokens == 12
    assert chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_responses_and_messages_through_the_ingress(cluster):
    """Both agent APIs are the OpenAI layer's: the ingress serves them as the aiohttp server does."""
    import anthropic

    client = openai.OpenAI(base_url=cluster + "/v1", api_key="unused", max_retries=0, timeout=60)
    first = client.responses.create(model=MODEL, input="hello there", max_output_tokens=6, temperature=0)
    events = list(client.responses.create(model=MODEL, input="hello there", max_output_tokens=6, temperature=0,
                                          stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == first.output_text
    second = client.responses.create(model=MODEL, input="and again", previous_response_id=first.id,
                                     max_output_tokens=2, temperature=0)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert client.responses.retrieve(first.id).output_text == first.output_text
    claude = anthropic.Anthropic(base_url=cluster, api_key="unused", max_retries=0, timeout=60)
    kw = dict(model=MODEL, max_tokens=6, messages=[{"role": "user", "content": "hello there"}],
              extra_body={"temperature": 0})
    m = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as s:
        assert s.get_final_message().content[0].text == m.content[0].text
    assert claude.messages.count_tokens(model=MODEL, messages=kw["messages"]).input_tokens == (
        m.usage.input_tokens + m.usage.cache_read_input_tokens + m.usage.cache_creation_input_tokens)
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(**kw, stop_sequences=[""])
    assert e.value.body["type"] == "error" and e.value.body["error"]["message"].startswith("stop_sequences:")


def test_a_deleted_stored_response_is_released_on_its_replica(cluster):
    """A stored Response's prompt is retained (an hour) on the replica that served it; DELETE at the
    ingress logs the release and that replica lets it go within a routing-stats period."""
    client = openai.OpenAI(base_url=cluster + "/v1", api_key="unused", max_retries=0, timeout=60)

    def retained() -> dict[str, float]:
        return _per_replica(_metrics(cluster), "prefixkv_replica_kv_blocks_retained")

    _fresh_digests(cluster)
    before = retained()
    r = client.responses.create(model=MODEL, input="keep this conversation for later, please", max_output_tokens=2,
                                temperature=0)
    _wait(lambda: any(n > before.get(rid, 0) for rid, n in retained().items()), 10,
          "the stored response's prompt retained")
    holder = next(rid for rid, n in retained().items() if n > before.get(rid, 0))
    client.responses.delete(r.id)
    # (releases other tests left pending may go with it: the count may fall further, never stay)
    _wait(lambda: retained()[holder] <= before.get(holder, 0), 20, "the retention released on its replica")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_errors_are_the_single_process_servers(cluster):
    url = cluster
    status, body = _post(url + "/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1})
    assert status == 400 and body["error"]["param"] == "temperature" and body["error"]["type"] == \
        "invalid_request_error"
    status, body = _post(url + "/v1/completions", {"model": "other", "prompt": "hi"})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, body = _post(url + "/v1/completions", {"model": MODEL, "prompt": [5] * 2000, "max_tokens": 1})
    assert status == 400 and "prompt" in body["error"]["message"]
    status, body = _post(url + "/v1/completions", {"model": MODEL, "prompt": "hi", "frobnicate": 1})
    assert status == 400 and body["error"]["param"] == "frobnicate"
    status, raw = _get(url + "/v1/nothing")
    assert status == 404 and json.loads(raw)["error"]["code"] == "not_found"
    status, raw = _get(url + "/v1/completions")
    assert status == 405 and json.loads(raw)["error"]["code"] == "method_not_allowed"
    # nothing of that reached an engine or broke one
    assert _complete(url, [5, 6, 7])["choices"][0]["finish_reason"] == "length"


def test_the_browser_pages_and_each_replicas_cache_view(cluster):
    url = cluster
    status, page = _get(url + "/")
    assert status == 200 and b"<html" in page.lower()
    with urllib.request.urlopen(url + "/cache", timeout=30) as r:
        assert "script-src 'self'" in r.headers["Content-Security-Policy"]
    assert _get(url + "/static/chat.js")[0] == 200
    status, raw = _get(url + "/static/nothing.js")
    assert status == 404 and json.loads(raw)["error"]["code"] == "not_found"
    _complete(url, list(range(30, 62)))  # something cached somewhere
    _fresh_digests(url)
    status, raw = _get(url + "/v1/cache/summary")
    body = json.loads(raw)
    assert status == 200 and body["object"] == "cache.summary" and body["replica"] in body["replicas"]
    assert sorted(body["replicas"]) == sorted(_health(url)["replicas"])
    assert body["tiers"]["device"]["cached"] == _health(url)["replicas"][body["replica"]]["cached_blocks"]
    assert body["text_shown"] is False and "text" not in json.dumps(body["tree"])
    other = next(r for r in body["replicas"] if r != body["replica"])
    one = json.loads(_get(url + f"/v1/cache/summary?replica={other}&max_nodes=1")[1])
    assert one["replica"] == other and one["tree"]["num_shown_nodes"] <= 1
    status, raw = _get(url + "/v1/cache/summary?replica=nope")
    assert status == 404 and json.loads(raw)["error"]["param"] == "replica"
    status, raw = _get(url + "/v1/cache/summary?max_nodes=65")
    assert status == 400 and json.loads(raw)["error"]["param"] == "max_nodes"


def _replica_actor(replica_id: str):
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith("SERVE_REPLICA::") and a["name"].endswith(replica_id):
            return ray.get_actor(a["name"], namespace=a["namespace"])
    raise AssertionError(f"no actor for replica {replica_id}")


def test_a_killed_replica_ends_its_streams_cleanly_and_is_replaced(cluster):
    url = cluster
    rng = random.Random(11)
    prefix = _tokens(rng, 40)
    _complete(url, prefix + [9])
    _fresh_digests(url)
    routed = _per_replica(_metrics(url), "prefixkv_replica_routed_requests_total")
    body = json.dumps({"model": MODEL, "prompt": prefix + [10], "max_tokens": 200, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        first = resp.readline()
        assert first.startswith(b"data: {")
        now = _per_replica(_metrics(url), "prefixkv_replica_routed_requests_total")
        (victim,) = [rid for rid in now if now[rid] > routed.get(rid, 0)]
        ray.kill(_replica_actor(victim), no_restart=True)
        events = [line for line in resp.read().split(b"\n\n") if line.strip()]
    assert events[-1] == b"data: [DONE]"
    err = json.loads(events[-2][len(b"data: "):])
    assert err["error"]["code"] == "replica_died", err
    # the other replica answers meanwhile; Serve starts a new one in the victim's place
    assert _complete(url, prefix + [11])["choices"][0]["finish_reason"] == "length"
    _wait(lambda: victim not in _health(url)["replicas"] and len(_health(url)["replicas"]) == 2, 120,
          "the killed replica replaced")
    assert _health(url)["status"] == "ok"
    for _ in range(3):
        assert _complete(url, _tokens(rng, 9))["choices"][0]["finish_reason"] == "length"


def test_a_client_that_goes_away_aborts_its_request_on_the_replica(cluster):
    url = cluster
    aborted = lambda: sum(_per_replica(_metrics(url), "prefixkv_replica_requests_aborted_total").values())  # noqa: E731
    before = aborted()
    body = json.dumps({"model": MODEL, "prompt": [7, 8, 9], "max_tokens": 250, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    resp = urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", body,
                                                         {"Content-Type": "application/json"}), timeout=60)
    assert resp.readline().startswith(b"data: {")
    resp.close()  # gone after the first token (the whole answer takes ~1 s: it would finish unaborted)
    running = lambda: sum(_per_replica(_metrics(url), "prefixkv_replica_num_requests_running").values())  # noqa: E731
    _wait(lambda: aborted() == before + 1, 30, "the abandoned request aborted on its replica")
    assert running() == 0
    assert sum(_per_replica(_metrics(url), "prefixkv_replica_kv_blocks_used").values()) == 0


def test_a_salt_is_routed_and_hit_only_by_its_own_requests(cluster):
    """``cache_salt`` through the ingress, the router and a replica: the router follows a salted
    prefix to the replica holding it for the same salt only, and another salt (or none) misses
    there too."""
    url = cluster
    prefix = _tokens(random.Random(45), 40)

    def send(salt: str | None, tail: int) -> tuple[int, float]:
        before = _metrics(url)['prefixkv_router_decisions_total{reason="prefix"}']
        body = {"model": MODEL, "prompt": prefix + [tail], "max_tokens": 2, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        status, out = _post(url + "/v1/completions", body)
        assert status == 200, out
        _fresh_digests(url)
        after = _metrics(url)['prefixkv_router_decisions_total{reason="prefix"}']
        return out["usage"]["prompt_tokens_details"]["cached_tokens"], after - before

    assert send("tenant-1", 3) == (0, 0)
    assert send("tenant-1", 4) == (40, 1)  # routed by its salted prefix, and a hit
    assert send("tenant-2", 5) == (0, 0)  # the router sees no match for another salt, nor the replica
    assert send(None, 6) == (0, 0)
    assert send("tenant-2", 7) == (40, 1)


def test_reset_prefix_cache_empties_every_replica(cluster):
    """``POST /reset_prefix_cache`` at the ingress: answered once every replica has reported, and then
    no replica caches a block; while a request runs on one of them, a 409 (requests_running)."""
    url = cluster
    rng = random.Random(46)
    for _ in range(6):
        _complete(url, _tokens(rng, 24))
    _fresh_digests(url)
    assert sum(r["cached_blocks"] for r in _health(url)["replicas"].values()) > 0
    assert _post(url + "/reset_prefix_cache", {}) == (200, {"success": True})
    _fresh_digests(url)
    assert {rid: r["cached_blocks"] for rid, r in _health(url)["replicas"].items()} == \
        {rid: 0 for rid in _health(url)["replicas"]}
    # a streamed request runs (~1 s for its 250 tokens) on one replica: that one refuses
    body = json.dumps({"model": MODEL, "prompt": [7, 8, 9], "max_tokens": 250, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    resp = urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", body,
                                                         {"Content-Type": "application/json"}), timeout=60)
    try:
        assert resp.readline().startswith(b"data: {")
        status, out = _post(url + "/reset_prefix_cache", {})
    finally:
        resp.close()
    assert status == 409 and out["error"]["code"] == "requests_running"
