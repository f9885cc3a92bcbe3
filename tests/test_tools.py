"""Tool calling (server/tools.py): the parsers and the plans alone, then through the server with the
real SmolLM2 and the official openai client (required, a named function, auto, streamed and not,
the round trip of tool calls and tool results through the chat template), and the 400s. On the same
server (one load of the model): the agent and evaluation APIs of issue 41 with the official SDKs --
Responses and Messages whole and streamed alike under greedy, the model's own tool calls round-tripped
in each API's shape, previous_response_id from the cache, and completions echo logprobs close to
transformers' on the same weights, cached or not."""

from __future__ import annotations

import json

import jsonschema
import pytest

from prefixkv.server.protocol import ProtocolError
from prefixkv.server.tools import plan_tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                                   "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                                  "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _run(plan, text: str, piece: int | None = None):
    """Feed ``text`` whole or in pieces of ``piece`` characters: (content deltas, tool-call deltas, stream)."""
    stream = plan.stream()
    contents, deltas = [], []
    for k in range(0, len(text), piece or max(len(text), 1)):
        c, d = stream.feed(text[k:k + (piece or len(text))])
        contents.append(c)
        deltas += d
    c, d = stream.close()
    return contents + [c], deltas + d, stream


# ---------------------------------------------------------------------- parsers and plans
@pytest.mark.parametrize("piece", [None, 1, 3])
def test_hermes_calls_and_content_whole_or_streamed(piece):
    plan = plan_tools(TOOLS, "auto", None, "hermes")
    text = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
            '</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    contents, deltas, stream = _run(plan, text, piece)
    assert "".join(contents) == "Let me check." == stream.content
    assert not any("<" in c for c in contents)  # a partial "<tool_call>" is held back, never sent as text
    assert [(c.name, json.loads(c.arguments)) for c in stream.calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("add", {"a": 1, "b": 2})]
    assert [(d.index, d.id, d.type, d.function.name) for d in deltas] == [
        (0, stream.calls[0].id, "function", "get_weather"), (1, stream.calls[1].id, "function", "add")]
    assert stream.calls[0].id != stream.calls[1].id and stream.calls[0].id.startswith("chatcmpl-tool-")


def test_parallel_tool_calls_false_keeps_the_first_call_of_an_auto_reply():
    for parser, text in [("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
                                    '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'),
                         ("llama3_json", '{"name": "add", "parameters": {"a": 1, "b": 2}}; '
                                         '{"name": "add", "parameters": {"a": 3, "b": 4}}')]:
        _, deltas, stream = _run(plan_tools(TOOLS, "auto", False, parser), text, 4)
        assert [json.loads(c.arguments) for c in stream.calls] == [{"a": 1, "b": 2}] and len(deltas) == 1
        assert stream.content is None
        _, _, both = _run(plan_tools(TOOLS, "auto", None, parser), text, 4)
        assert len(both.calls) == 2


def test_hermes_text_that_is_not_a_call_stays_content():
    plan = plan_tools(TOOLS, "auto", None, "hermes")
    for text in ['a <tool_call>{"name": "nope", "arguments": {}}</tool_call> b',  # not one of the tools
                 'a <tool_call>{"name": "add", "argu',  # cut off
                 "x < y and <tool c"]:
        contents, deltas, stream = _run(plan, text, 2)
        assert "".join(contents) == text and not deltas and not stream.calls


@pytest.mark.parametrize("piece", [None, 2])
def test_llama3_json_calls(piece):
    plan = plan_tools(TOOLS, "auto", None, "llama3_json")
    text = '<|python_tag|>{"name": "add", "parameters": {"a": 3, "b": 4}}; {"name": "get_weather", ' \
           '"parameters": {"city": "Oslo", "unit": "celsius"}}'
    contents, deltas, stream = _run(plan, text, piece)
    assert "".join(contents) == "" and stream.content is None
    assert [(c.name, json.loads(c.arguments)) for c in stream.calls] == [
        ("add", {"a": 3, "b": 4}), ("get_weather", {"city": "Oslo", "unit": "celsius"})]
    contents, deltas, stream = _run(plan, "Just text {not a call}", piece)
    assert "".join(contents) == "Just text {not a call}" and not stream.calls
    contents, deltas, stream = _run(plan, '{"name": "add", "parameters": {"a": 1', piece)  # cut off: text
    assert "".join(contents) == '{"name": "add", "parameters": {"a": 1' and not stream.calls


def test_required_array_items_become_calls_as_they_complete():
    plan = plan_tools(TOOLS, "required", None, None)
    text = '[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "get_weather", "parameters": ' \
           '{"city": "} {\\" [", "unit": "celsius"}}]'
    stream = plan.stream()
    seen = []
    for k, ch in enumerate(text):
        _, d = stream.feed(ch)
        seen += [(k, x.function.name) for x in d]
    assert [name for _, name in seen] == ["add", "get_weather"]
    assert seen[0][0] == text.index("}}") + 1  # the first call is sent when its object closes
    assert json.loads(stream.calls[1].arguments) == {"city": '} {" [', "unit": "celsius"}


def test_named_function_streams_its_arguments():
    plan = plan_tools(TOOLS, {"type": "function", "function": {"name": "add"}}, None, None)
    assert plan.structured_outputs == {"json": ADD["function"]["parameters"]}
    stream = plan.stream()
    first = stream.feed('{"a": ')[1]
    assert [(d.index, d.type, d.function.name, d.function.arguments) for d in first] == [
        (0, "function", "add", ""), (0, None, None, '{"a": ')]
    assert stream.feed("1}")[1][0].function.arguments == "1}"
    assert json.loads(stream.calls[0].arguments) == {"a": 1} and plan.calls_finish_reason == "stop"


def test_required_schema_lists_each_tool_and_parallel_calls_limit_it():
    plan = plan_tools(TOOLS, "required", False, None)
    schema = plan.structured_outputs["json"]
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    ok = [{"name": "add", "parameters": {"a": 1, "b": 2}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "add", "parameters": {"a": 1}}], [{"name": "sub", "parameters": {}}], ok + ok):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert "maxItems" not in plan_tools(TOOLS, "required", None, None).structured_outputs["json"]


@pytest.mark.parametrize("tools, choice, parser, param", [
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, None, "tool_choice.function.name"),
    (TOOLS, "auto", None, "tool_choice"),  # auto needs --tool-call-parser
    (None, "required", "hermes", "tool_choice"),  # tool_choice without tools
    (TOOLS, "sometimes", "hermes", "tool_choice"),
    ([{"type": "retrieval"}], "required", None, "tools[0].type"),
    ([{"type": "function", "function": {"name": "has space"}}], "required", None, "tools[0].function.name"),
    ([ADD, ADD], "required", None, "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "required", None,
     "tools[0].function.parameters"),
])
def test_bad_tools_name_the_field(tools, choice, parser, param):
    with pytest.raises(ProtocolError) as e:
        plan_tools(tools, choice, None, parser)
    assert e.value.param == param and e.value.message.startswith(param + ":")


# ---------------------------------------------------------------------- the server, SmolLM2
@pytest.fixture(scope="module")
def served():
    """SmolLM2 served (``--tool-call-parser auto``: hermes for its ChatML template), with its engine."""
    from prefixkv.async_engine import AsyncEngine
    from prefixkv.config import EngineConfig
    from prefixkv.engine import LLMEngine
    from prefixkv.server.app import BackgroundServer, ServerConfig

    engine = LLMEngine(EngineConfig(model=None, dtype="float32"))
    with BackgroundServer(AsyncEngine(engine), ServerConfig("smollm2", tool_call_parser="auto")) as srv:
        yield srv, engine


@pytest.fixture(scope="module")
def client(served):
    import openai

    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0)


ASK = [{"role": "user", "content": "What is the weather in Paris? And what is 2 plus 3?"}]


def _streamed(client, **kw):
    """The streamed reply accumulated as an OpenAI client user does: (content, calls, finish)."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model="smollm2", stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                c["id"] = d.id or c["id"]
                c["name"] += (d.function.name or "") if d.function else ""
                c["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = ch.finish_reason or finish
    return content, [calls[k] for k in sorted(calls)], finish


def _valid(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


@pytest.mark.parametrize("parallel", [False, None])
def test_required_tool_calls_parse_and_match_their_schemas(client, parallel):
    kw = dict(messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=120)
    if parallel is not None:
        kw["parallel_tool_calls"] = parallel
    r = client.chat.completions.create(model="smollm2", **kw)
    choice = r.choices[0]
    calls = choice.message.tool_calls
    assert calls and all(c.type == "function" and c.function.name in SCHEMAS for c in calls), choice
    parsed = [_valid(c.function.name, c.function.arguments) for c in calls if choice.finish_reason == "tool_calls"
              or c is not calls[-1]]  # (with parallel calls allowed the last may be cut by max_tokens)
    assert parsed
    if parallel is False:
        assert len(calls) == 1 and choice.finish_reason == "tool_calls" and choice.message.content is None
        content, streamed, finish = _streamed(client, **kw)
        assert (content, finish) == ("", "tool_calls")
        assert [(c["name"], c["arguments"]) for c in streamed] == [(c.function.name, c.function.arguments)
                                                                  for c in calls]
        assert streamed[0]["id"].startswith("chatcmpl-tool-")


def test_named_function_call(client):
    kw = dict(messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
              temperature=0, max_tokens=60)
    r = client.chat.completions.create(model="smollm2", **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None  # OpenAI's forced function
    (call,) = choice.message.tool_calls
    assert call.function.name == "add" and set(_valid("add", call.function.arguments)) == {"a", "b"}
    content, streamed, finish = _streamed(client, **kw)
    assert (content, finish) == ("", "stop")
    assert [(c["name"], c["arguments"]) for c in streamed] == [("add", call.function.arguments)]


CALL_FORMAT = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,12}", "unit": "celsius"\}\}\n</tool_call>'


def test_auto_parses_the_models_tool_call_format(client):
    """tool_choice auto: the hermes parser reads the call out of the model's own reply (the reply
    is held to the format with a regex here, because a 135M model seldom writes one itself)."""
    kw = dict(messages=ASK, tools=TOOLS, temperature=0, max_tokens=60,
              extra_body={"structured_outputs": {"regex": r"Checking\. " + CALL_FORMAT}})
    r = client.chat.completions.create(model="smollm2", **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking. "
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and _valid("get_weather", call.function.arguments)["unit"] == "celsius"
    content, streamed, finish = _streamed(client, **kw)
    assert (content, finish) == ("Checking. ", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in streamed] == [("get_weather", call.function.arguments)]


def test_auto_plain_reply_is_content_and_none_is_text(client):
    for choice_ in ("auto", "none"):
        kw = dict(messages=[{"role": "user", "content": "Say hello."}], tools=TOOLS, tool_choice=choice_,
                  temperature=0, max_tokens=12)
        r = client.chat.completions.create(model="smollm2", **kw)
        assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
        content, streamed, finish = _streamed(client, **kw)
        assert content == r.choices[0].message.content and not streamed and finish == r.choices[0].finish_reason


def test_tool_calls_and_results_round_trip_through_the_template(client):
    first = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=60)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    second = client.chat.completions.create(model="smollm2", messages=history, tools=[WEATHER], tool_choice="none",
                                            temperature=0, max_tokens=20)
    assert second.choices[0].message.content and second.choices[0].message.tool_calls is None
    # the template rendered the call and the result: the prompt holds both
    from prefixkv.tokenizer import HERMES_TOOLS_CHATML_TEMPLATE, _compiled_template, _normalize_messages

    text = _compiled_template(HERMES_TOOLS_CHATML_TEMPLATE).render(
        messages=_normalize_messages([dict(m) for m in history]), tools=[WEATHER], add_generation_prompt=True)
    assert f'"name": "get_weather", "arguments": {call.function.arguments}' in text
    assert "<tool_response>\n18 degrees and sunny\n</tool_response>" in text
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 20


@pytest.mark.parametrize("body, param", [
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice.function.name"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                              "properties": {"x": {"type": "nope"}}}}}],
          tool_choice={"type": "function", "function": {"name": "f"}}), "tools[0].function.parameters"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "bogus": 1}}]), "tools[0].function.bogus"),
    (dict(messages=ASK + [{"role": "tool", "tool_call_id": "nope", "content": "18 C"}]), "messages[1].tool_call_id"),
    (dict(messages=ASK + [{"role": "tool", "content": "18 C"}]), "messages[1].tool_call_id"),
])
def test_bad_tool_requests_are_400_naming_the_field(client, body, param):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", **{"messages": ASK, "max_tokens": 5, **body})
    assert e.value.body["param"] == param, e.value.body
    assert e.value.body["message"].startswith(param + ":"), e.value.body
    ok = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=2)  # the server goes on
    assert ok.choices[0].finish_reason == "length"


# ---------------------------------------------------------------------- the agent APIs (issue 41)
FLAT_WEATHER = {"name": "get_weather", "description": "Get the current weather in a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
AGENT_ASK = "What is the weather in Paris?"


def test_responses_whole_streamed_tools_and_chain(client):
    kw = dict(model="smollm2", input="Name three colors.", max_output_tokens=24, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    assert events[-1].response.output_text == whole.output_text and whole.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    nxt = client.responses.create(model="smollm2", input="And two more.", previous_response_id=whole.id,
                                  max_output_tokens=8, temperature=0)
    assert nxt.usage.input_tokens_details.cached_tokens >= whole.usage.input_tokens // 16 * 16
    tools = [{"type": "function", **FLAT_WEATHER}]
    r = client.responses.create(model="smollm2", input=AGENT_ASK, tools=tools, tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and "city" in json.loads(call.arguments)
    answer = client.responses.create(model="smollm2", previous_response_id=r.id, tools=tools, tool_choice="none",
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "18 degrees and sunny"}], max_output_tokens=20, temperature=0)
    assert answer.output_text and answer.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens // 16 * 16


def test_messages_whole_streamed_and_tools(served):
    import anthropic

    client = anthropic.Anthropic(base_url=served[0].url, api_key="unused", max_retries=0)
    kw = dict(model="smollm2", max_tokens=24, messages=[{"role": "user", "content": "Name three colors."}],
              extra_body={"temperature": 0})
    m = client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == m.content[0].text == final.content[0].text and final.stop_reason == m.stop_reason
    tools = [{"name": FLAT_WEATHER["name"], "description": FLAT_WEATHER["description"], "input_schema": FLAT_WEATHER["parameters"]}]
    ask = [{"role": "user", "content": AGENT_ASK}]
    r = client.messages.create(model="smollm2", max_tokens=60, messages=ask, tools=tools,
                               tool_choice={"type": "any", "disable_parallel_tool_use": True},
                               extra_body={"temperature": 0})
    (use,) = r.content
    assert r.stop_reason == "tool_use" and use.name == "get_weather" and "city" in use.input
    answer = client.messages.create(model="smollm2", max_tokens=20, tools=tools, extra_body={"temperature": 0},
                                    messages=ask + [{"role": "assistant", "content": [use.model_dump(
                                        include={"type", "id", "name", "input"})]},
                                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                                      "content": "18 degrees and sunny"}]}])
    assert answer.content[0].type == "text" and answer.usage.cache_read_input_tokens >= 16


def test_echo_logprobs_close_to_transformers(served, client):
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(served[1].model_path), dtype=torch.float32)
    text = "The capital of France is Paris, and the capital of Italy is Rome."
    ids = served[1].tokenizer.encode(text)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
    want = [ref[j - 1, ids[j]].item() for j in range(1, len(ids))]
    for _ in ("uncached", "cached"):  # the second time the prompt's blocks are in the prefix cache
        r = client.completions.create(model="smollm2", prompt=text, echo=True, logprobs=1, max_tokens=0)
        got = r.choices[0].logprobs.token_logprobs
        assert got[0] is None and len(got) == len(ids)
        assert max(abs(g - w) for g, w in zip(got[1:], want)) < 2e-3
    warm = client.completions.create(model="smollm2", prompt=text, max_tokens=1)
    assert warm.usage.prompt_tokens_details.cached_tokens >= len(ids) // 16 * 16
