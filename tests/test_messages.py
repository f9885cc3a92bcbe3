"""Anthropic's Messages API (issue 41) through the official anthropic SDK against the real server on a
tiny float64 model: streamed equal to whole under greedy, the event sequence, tool_use / tool_result
round trips, cache_control reported as cache reads and writes, count_tokens equal to the usage, 400s in
Anthropic's error shape, x-api-key."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import anthropic
import pytest

from prefixkv import LLM
from prefixkv.async_engine import AsyncEngine
from prefixkv.server.app import BackgroundServer, ServerConfig

BLOCK = 4
KEY = "sk-test"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
          "required": ["city"], "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
WEATHER = {"name": "get_weather", "description": "The weather in a city.", "input_schema": SCHEMA}
GREEDY = {"temperature": 0}  # (this SDK's create() has no temperature argument)


@pytest.fixture(scope="module")
def server(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float64", num_kv_blocks=512, block_size=BLOCK)
    engine = AsyncEngine(llm.engine)
    with BackgroundServer(engine, ServerConfig("t", api_key=KEY)) as srv:
        yield srv
    engine.close()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def _events(client, **kw):
    with client.messages.stream(extra_body=GREEDY, **kw) as s:
        events = list(s)
        return events, s.get_final_message()


def test_text_whole_and_streamed(client):
    kw = dict(model="t", max_tokens=10, system="Be brief.", messages=[{"role": "user", "content": "Hello"}])
    m = client.messages.create(extra_body=GREEDY, **kw)
    assert m.type == "message" and m.role == "assistant" and m.stop_reason == "max_tokens"
    (block,) = m.content
    assert block.type == "text" and m.usage.output_tokens == 10
    events, final = _events(client, **kw)
    types = [e.type for e in events if not e.type.startswith(("text", "content_block_delta"))]
    assert types == ["message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop"]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == block.text
    assert final.content[0].text == block.text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 10 and final.usage.input_tokens + final.usage.cache_read_input_tokens == (
        m.usage.input_tokens + m.usage.cache_read_input_tokens)


def test_stop_sequence(client):
    first = client.messages.create(model="t", max_tokens=12, messages=[{"role": "user", "content": "Go"}],
                                   extra_body=GREEDY).content[0].text
    stop = first[3:5]
    m = client.messages.create(model="t", max_tokens=12, messages=[{"role": "user", "content": "Go"}],
                               stop_sequences=[stop], extra_body=GREEDY)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    assert m.content[0].text == first[:first.index(stop)]


def test_tool_use_round_trip(client):
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    kw = dict(model="t", max_tokens=40, messages=ask, tools=[WEATHER],
              tool_choice={"type": "tool", "name": "get_weather"})
    m = client.messages.create(extra_body=GREEDY, **kw)
    (use,) = m.content
    assert m.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "get_weather"
    assert use.input["city"] in ("Paris", "Rome")
    events, final = _events(client, **kw)
    partial = "".join(e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert json.loads(partial) == use.input and final.content[0].input == use.input
    assert final.stop_reason == "tool_use"
    history = ask + [{"role": "assistant", "content": [use.model_dump(include={"type", "id", "name", "input"})]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C"},
                                                  {"type": "text", "text": "And tomorrow?"}]}]
    r = client.messages.create(model="t", max_tokens=4, messages=history, tools=[WEATHER],
                               tool_choice={"type": "none"}, extra_body=GREEDY)
    assert r.content[0].type == "text" and r.stop_reason == "max_tokens"
    # the call and its result are in the prompt: it holds the first one's (from the cache)
    first_prompt = m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens > first_prompt + 10
    assert r.usage.cache_read_input_tokens >= first_prompt // BLOCK * BLOCK - BLOCK


def test_cache_control_reported_as_reads(client):
    system = [{"type": "text", "text": "You are a careful assistant. " * 6, "cache_control": {"type": "ephemeral"}}]
    kw = dict(model="t", max_tokens=2, system=system, extra_body=GREEDY)
    ask = lambda q: [{"role": "user", "content": q}]  # noqa: E731
    n = client.messages.count_tokens(model="t", system=system, messages=ask("First question?")).input_tokens
    a = client.messages.create(messages=ask("First question?"), **kw).usage
    assert a.input_tokens + a.cache_read_input_tokens + a.cache_creation_input_tokens == n
    # the system prompt, written (but for its first tokens, which earlier prompts cached)
    assert a.cache_read_input_tokens < 4 * BLOCK and a.cache_creation_input_tokens > 40
    marked = a.cache_creation_input_tokens + a.cache_read_input_tokens
    b = client.messages.create(messages=ask("Second one?"), **kw).usage
    # the marked prefix is read back (whole blocks of it), the rest of it and the question computed
    assert marked // BLOCK * BLOCK <= b.cache_read_input_tokens <= marked
    assert b.cache_creation_input_tokens == marked - b.cache_read_input_tokens
    assert b.input_tokens + b.cache_read_input_tokens + b.cache_creation_input_tokens == client.messages.count_tokens(
        model="t", system=system, messages=ask("Second one?")).input_tokens
    plain = client.messages.create(model="t", max_tokens=2, messages=ask("Second one?"), extra_body=GREEDY).usage
    assert plain.cache_creation_input_tokens == 0  # nothing marked: nothing written on purpose
    top = client.messages.create(messages=ask("Third."), cache_control={"type": "ephemeral", "ttl": "1h"}, **kw).usage
    assert top.input_tokens == 0  # the whole prompt marked: read or written


def _raw(server, body: dict, headers: dict) -> tuple[int, dict]:
    req = urllib.request.Request(server.url + "/v1/messages", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_x_api_key_and_error_shape(server):
    body = {"model": "t", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    status, got = _raw(server, body, {"x-api-key": KEY, "anthropic-version": "2023-06-01"})
    assert status == 200 and got["type"] == "message"
    status, got = _raw(server, body, {"x-api-key": "wrong"})
    assert status == 401 and got["type"] == "error" and got["error"]["type"] == "authentication_error"
    status, got = _raw(server, {**body, "model": "claude"}, {"x-api-key": KEY})
    assert status == 404 and got["error"]["type"] == "not_found_error" and got["error"]["message"].startswith("model:")


@pytest.mark.parametrize("body, field", [
    ({"bogus": 1}, "bogus"),
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x", "content": "1"}]}]},
     "messages[0].content[0].tool_use_id"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"system": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]},
     "system[0].cache_control.ttl"),
    ({"system": [{"type": "text", "text": "x", "cache_control": {"type": "persistent"}}]},
     "system[0].cache_control.type"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking.type"),
    ({"container": "x"}, "container"),
    ({"stop_sequences": [""]}, "stop_sequences"),
])
def test_bad_requests_are_400_in_anthropics_shape(client, body, field):
    base = {"model": "t", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.post("/v1/messages", body={**base, **body}, cast_to=object)
    err = e.value.body
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    assert err["error"]["message"].startswith(field + ":"), err
    ok = client.messages.create(**base, extra_body=GREEDY)  # the server goes on
    assert ok.stop_reason == "max_tokens"
