"""Retention through the server (README "Retention"), on a tiny float64 model with a small KV pool
that a flood of other prompts fills many times over: ``kv_retention`` on chat and completions (and
its 400s), Anthropic's ``cache_control`` read back after the flood, a stored Responses conversation
continued after it; the metrics."""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request

import pytest

from prefixkv import LLM
from prefixkv.async_engine import AsyncEngine
from prefixkv.server.app import BackgroundServer, ServerConfig

BLOCK = 4
NUM_BLOCKS = 96  # 384 tokens; at most half of them retained


@pytest.fixture(scope="module")
def server(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float64", num_kv_blocks=NUM_BLOCKS, block_size=BLOCK)
    engine = AsyncEngine(llm.engine)
    with BackgroundServer(engine, ServerConfig("t")) as srv:
        yield srv
    engine.close()


def _post(srv, path: str, body: dict, method: str = "POST") -> tuple[int, dict]:
    req = urllib.request.Request(srv.url + path, json.dumps(body).encode() if body is not None else None,
                                 {"Content-Type": "application/json", "anthropic-version": "2023-06-01"},
                                 method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 380) for _ in range(n)]  # (the tiny vocabulary: 384)


def _flood(srv, base: int) -> None:
    """24 distinct prompts of 60 tokens: 1440 tokens through a 384-token pool."""
    for i in range(24):
        status, out = _post(srv, "/v1/completions", {"prompt": _tokens(base + i, 60), "max_tokens": 1,
                                                      "temperature": 0})
        assert status == 200, out


def _chat(srv, system: str, question: str, **extra) -> dict:
    status, out = _post(srv, "/v1/chat/completions", {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 2, "temperature": 0, **extra})
    assert status == 200, out
    return out["usage"]


def _stats(srv) -> dict[str, float]:
    with urllib.request.urlopen(srv.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(("prefixkv_kv_blocks_retained ", "prefixkv_retention_", "prefixkv_kv_retained_")):
            name, value = line.split()
            out[name] = float(value)
    return out


def test_chat_kv_retention_keeps_the_prompt_through_a_flood(server):
    system = "You answer weather questions, briefly."
    for retained in (False, True):
        extra = {"kv_retention": {"ttl_s": 300}} if retained else {}
        first = _chat(server, system + ("A" if retained else "B"), "Where?", **extra)
        prompt = first["prompt_tokens"]
        assert 30 < prompt < 120
        _flood(server, 1000 + 5000 * retained)
        again = _chat(server, system + ("A" if retained else "B"), "When?")
        cached = again["prompt_tokens_details"]["cached_tokens"]
        if retained:  # the whole prompt's full blocks but for the question's part
            assert cached >= (prompt - 8) // BLOCK * BLOCK - BLOCK
        else:
            assert cached < 2 * BLOCK  # the template's first tokens at most (a flood prompt never shares them)
    stats = _stats(server)
    assert stats["prefixkv_kv_blocks_retained"] >= (prompt - 1) // BLOCK
    assert stats["prefixkv_retention_lapsed_total"] == 0


def test_completions_kv_retention_num_tokens(server):
    prompt = _tokens(20_000, 40)
    status, out = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                                    "kv_retention": {"ttl_s": 60, "num_tokens": 16}})
    assert status == 200, out
    _flood(server, 30_000)
    status, out = _post(server, "/v1/completions", {"prompt": prompt + [1], "max_tokens": 1, "temperature": 0})
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 16


@pytest.mark.parametrize("value, param", [
    ({"ttl_s": -1}, "kv_retention.ttl_s"),
    ({"ttl_s": 0}, "kv_retention.ttl_s"),
    ({"ttl_s": 1e9}, "kv_retention.ttl_s"),
    ({"ttl_s": 10, "num_tokens": 0}, "kv_retention.num_tokens"),
    ({"ttl_s": "5m"}, "kv_retention.ttl_s"),
    ({"num_tokens": 5}, "kv_retention.ttl_s"),
    ({"ttl_s": 10, "pin": True}, "kv_retention.pin"),
])
def test_kv_retention_errors_name_the_field(server, value, param):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        status, out = _post(server, path, {**body, "max_tokens": 1, "kv_retention": value})
        assert status == 400, (path, value, out)
        assert out["error"]["param"] == param and param in out["error"]["message"], out


def test_anthropic_cache_control_is_read_back_after_a_flood(server):
    system = [{"type": "text", "text": "You are a terse ski shop assistant.",
               "cache_control": {"type": "ephemeral"}}]
    body = {"model": "t", "max_tokens": 2, "temperature": 0, "system": system}
    status, a = _post(server, "/v1/messages", {**body, "messages": [{"role": "user", "content": "Skis?"}]})
    assert status == 200, a
    marked = a["usage"]["cache_creation_input_tokens"] + a["usage"]["cache_read_input_tokens"]
    assert marked > 20
    _flood(server, 40_000)
    status, b = _post(server, "/v1/messages", {**body, "messages": [{"role": "user", "content": "Boots?"}]})
    assert marked // BLOCK * BLOCK <= b["usage"]["cache_read_input_tokens"] <= marked
    # without the mark, a system prompt (another one: this one is still retained) is gone after a flood
    plain = [{"type": "text", "text": "Z" + system[0]["text"]}]
    status, c = _post(server, "/v1/messages", {**body, "system": plain, "messages": [{"role": "user", "content": "A"}]})
    _flood(server, 50_000)
    status, d = _post(server, "/v1/messages", {**body, "system": plain, "messages": [{"role": "user", "content": "B"}]})
    # (at most the template's first blocks, which it shares with the prompts still retained)
    assert d["usage"]["cache_read_input_tokens"] <= 2 * BLOCK < marked // BLOCK * BLOCK


def test_stored_response_conversation_is_kept_through_a_flood(server):
    status, r1 = _post(server, "/v1/responses", {"model": "t", "max_output_tokens": 3, "temperature": 0,
                                                 "input": "Tell me about the glaciers."})
    assert status == 200, r1
    prompt = r1["usage"]["input_tokens"]
    _flood(server, 60_000)
    status, r2 = _post(server, "/v1/responses", {"model": "t", "max_output_tokens": 3, "temperature": 0,
                                                 "previous_response_id": r1["id"], "input": "And the lakes?"})
    assert status == 200, r2
    assert r2["usage"]["input_tokens_details"]["cached_tokens"] >= (prompt - 1) // BLOCK * BLOCK - BLOCK


def _respond(srv, **body) -> dict:
    status, out = _post(srv, "/v1/responses", {"model": "t", "max_output_tokens": 3, "temperature": 0, **body})
    assert status == 200, out
    return out


def _delete(srv, response_id: str) -> None:
    status, out = _post(srv, f"/v1/responses/{response_id}", None, method="DELETE")
    assert status == 200 and out == {"id": response_id, "object": "response.deleted", "deleted": True}, out


def _cached_input(out: dict) -> int:
    return out["usage"]["input_tokens_details"]["cached_tokens"]


def test_deleting_a_stored_response_releases_its_retention(server):
    """The same conversation sent again after a flood (its turns as input items, not stored): kept
    while its stored response is, gone once the response is deleted."""
    for deleted in (False, True):
        question = "Rivers: which run north, and how far?" if deleted else "Forests of the north, please."
        r1 = _respond(server, input=question)
        full = (r1["usage"]["input_tokens"] - 1) // BLOCK * BLOCK
        if deleted:
            _delete(server, r1["id"])
        _flood(server, 70_000 + 1000 * deleted)
        reply = r1["output"][0]["content"][0]["text"]
        again = _respond(server, store=False, input=[{"role": "user", "content": question},
                                                     {"role": "assistant", "content": reply},
                                                     {"role": "user", "content": "And the lakes?"}])
        if deleted:  # (at most the template's first blocks, which other retained prompts share)
            assert _cached_input(again) <= 2 * BLOCK < full - BLOCK
        else:
            assert _cached_input(again) >= full - BLOCK


def test_a_deleted_response_keeps_the_prefix_a_chained_or_twin_response_retains(server):
    """Retentions are held per response: deleting one response leaves the prefix that another
    stored response holds -- the same input stored twice, or a previous_response_id continuation
    (whose prompt begins with the deleted turn's) -- through a flood."""
    twin_a = _respond(server, input="Describe the harbour at dawn.")
    twin_b = _respond(server, input="Describe the harbour at dawn.")
    c1 = _respond(server, input="Name the planets, slowly.")
    c2 = _respond(server, previous_response_id=c1["id"], input="And their moons?")
    assert _cached_input(c2) >= (c1["usage"]["input_tokens"] - 1) // BLOCK * BLOCK - BLOCK
    _delete(server, twin_a["id"])
    _delete(server, c1["id"])
    _flood(server, 80_000)
    b2 = _respond(server, previous_response_id=twin_b["id"], input="And at dusk?", store=False)
    c3 = _respond(server, previous_response_id=c2["id"], input="Which is largest?", store=False)
    assert _cached_input(b2) >= (twin_b["usage"]["input_tokens"] - 1) // BLOCK * BLOCK - BLOCK
    assert _cached_input(c3) >= (c2["usage"]["input_tokens"] - 1) // BLOCK * BLOCK - BLOCK
    status, _ = _post(server, f"/v1/responses/{c1['id']}", None, method="GET")
    assert status == 404
