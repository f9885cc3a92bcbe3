"""OpenAI's Responses API (issue 41) through the official openai SDK against the real server on a
tiny float64 model: streamed equal to whole under greedy, the event sequence, function calls and their
outputs round trip, previous_response_id continuing a stored conversation from the prefix cache, the
store's bound, GET / DELETE, 400s naming the field."""

from __future__ import annotations

import json

import openai
import pytest

from prefixkv import LLM
from prefixkv.async_engine import AsyncEngine
from prefixkv.server.app import BackgroundServer, ServerConfig
from prefixkv.server.responses import ResponseStore

BLOCK = 4
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                          "required": ["city"], "additionalProperties": False,
                          "x-guidance": {"whitespace_flexible": False}}}
NAMED = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def client(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float64", num_kv_blocks=512, block_size=BLOCK)
    engine = AsyncEngine(llm.engine)
    with BackgroundServer(engine, ServerConfig("t", max_stored_responses=4)) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    engine.close()


def _same(a, b) -> None:
    """Two responses to the same request: the same output, usage aside from the cache."""
    strip = lambda r: [{k: v for k, v in i.model_dump().items() if k not in ("id", "call_id")}  # noqa: E731
                       for i in r.output]
    assert strip(a) == strip(b) and a.status == b.status
    assert (a.usage.input_tokens, a.usage.output_tokens) == (b.usage.input_tokens, b.usage.output_tokens)


def test_text_whole_and_streamed(client):
    kw = dict(model="t", input="Tell me a story.", instructions="Be brief.", max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kw)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    (msg,) = whole.output
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "output_text"
    assert whole.output_text == msg.content[0].text and whole.usage.output_tokens == 12
    assert whole.usage.total_tokens == whole.usage.input_tokens + 12
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    _same(events[-1].response, whole)
    assert client.responses.retrieve(events[-1].response.id).output_text == whole.output_text


def test_previous_response_id_continues_from_the_cache(client):
    first = client.responses.create(model="t", input="My name is Ada.", max_output_tokens=6, temperature=0)
    second = client.responses.create(model="t", input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0)
    # the second prompt holds the first one and its reply: their blocks come from the prefix cache
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // BLOCK * BLOCK
    third = client.responses.create(model="t", input="Thanks.", previous_response_id=second.id,
                                    max_output_tokens=4, temperature=0)
    assert third.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens // BLOCK * BLOCK
    assert third.previous_response_id == second.id
    # the same conversation sent whole renders the same prompt
    whole = client.responses.create(model="t", max_output_tokens=4, temperature=0, store=False, input=[
        {"role": "user", "content": "My name is Ada."},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
        {"role": "user", "content": "What is my name?"},
        {"role": "assistant", "content": second.output_text}, {"role": "user", "content": "Thanks."}])
    _same(whole, third)


def test_function_call_round_trip(client):
    kw = dict(model="t", input="Weather in Paris?", tools=[WEATHER], tool_choice=NAMED, max_output_tokens=40,
              temperature=0)
    r = client.responses.create(**kw)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    events = list(client.responses.create(stream=True, **kw))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args == call.arguments and [(d.name, d.arguments) for d in done] == [("get_weather", call.arguments)]
    _same(events[-1].response, r)
    out = client.responses.create(model="t", previous_response_id=r.id, tools=[WEATHER], max_output_tokens=5,
                                  temperature=0, tool_choice="none",
                                  input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}])
    assert out.output[0].type == "message" and out.usage.input_tokens > r.usage.input_tokens
    assert out.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens // BLOCK * BLOCK
    # the same turn sent as items (no previous_response_id): the same prompt
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}]
    again = client.responses.create(model="t", input=items, tools=[WEATHER], tool_choice="none", max_output_tokens=5,
                                    temperature=0)
    _same(again, out)


def test_json_schema_format(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
    r = client.responses.create(model="t", input="Answer.", max_output_tokens=20, temperature=0,
                                text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    assert isinstance(json.loads(r.output_text)["ok"], bool) and r.text.format.type == "json_schema"


def test_get_delete_and_the_bound(client):
    ids = [client.responses.create(model="t", input=f"n{i}", max_output_tokens=1).id for i in range(5)]
    with pytest.raises(openai.NotFoundError):  # the store holds 4: the least recently used went
        client.responses.retrieve(ids[0])
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="t", input="x", previous_response_id=ids[0], max_output_tokens=1)
    assert e.value.body["param"] == "previous_response_id"
    assert client.responses.retrieve(ids[1]).id == ids[1]  # (now the most recently used)
    client.responses.delete(ids[1])
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[1])
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(ids[1])
    unstored = client.responses.create(model="t", input="x", max_output_tokens=1, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_store_bounds_count_and_bytes():
    dropped: list[str] = []  # what the server releases the retentions of
    store = ResponseStore(max_responses=3, max_bytes=400, on_drop=dropped.append)
    conv = [{"role": "user", "content": "x" * 60}]
    for i in range(3):
        store.put({"id": f"r{i}"}, conv)
    assert len(store) == 3 and store.num_bytes <= 400
    store.get("r0")  # r1 is now the least recently used
    store.put({"id": "r3"}, conv)
    assert [store.get(f"r{i}") is not None for i in range(4)] == [True, False, True, True]
    store.put({"id": "big"}, [{"role": "user", "content": "x" * 300}])  # over the bytes: older ones go
    assert store.num_bytes <= 400 and store.get("big") is not None and len(store) < 4
    store.put({"id": "huge"}, [{"role": "user", "content": "x" * 500}])  # larger than the store: not kept
    assert store.get("huge") is None and store.get("big") is not None
    # r1 past the count, the rest (least recently used first) past the bytes, huge never kept
    assert dropped == ["r1", "r0", "r2", "r3", "huge"]
    assert store.drop("big") and not store.drop("big") and dropped[-1] == "big" and len(dropped) == 6


@pytest.mark.parametrize("body, param", [
    ({"bogus": 1}, "bogus"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {}, "bogus": 1}]}, "tools[0].bogus"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"truncation": "auto"}, "truncation"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
])
def test_bad_requests_are_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**{"model": "t", "input": "x", "max_output_tokens": 2, **{
            k: v for k, v in body.items() if k in ("input", "max_output_tokens")}},
            extra_body={k: v for k, v in body.items() if k not in ("input", "max_output_tokens")})
    assert e.value.body["param"] == param and e.value.body["message"].startswith(param + ":"), e.value.body
    assert e.value.body["type"] == "invalid_request_error"
