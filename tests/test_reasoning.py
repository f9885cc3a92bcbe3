"""--reasoning-parser (issue 41): <think> ... </think> split out of replies, whole or streamed in any
pieces, with tool calls after it; --tool-call-parser auto picks the parser from the chat template;
through the server on a tiny model (the reply held to a shape by a regex: a random model writes none)."""

from __future__ import annotations

import openai
import pytest

from prefixkv.server.reasoning import ReasoningStream, ReplyParser, thinking_enabled
from prefixkv.server.tools import detect_tool_parser, plan_tools
from prefixkv.tokenizer import FALLBACK_CHAT_TEMPLATE

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("text, reasoning, answer", [
    ("<think>\nLet me see.\n</think>\n\nParis.", "\nLet me see.\n", "Paris."),
    ("Let me see.</think>Paris.", "Let me see.", "Paris."),  # <think> was in the prompt
    ("  <think>cut short by max_tokens", "cut short by max_tokens", None),
    ("<think></think>Paris </thin", None, "Paris </thin"),
    ("<thi", "<thi", None),
])
def test_reasoning_split_whole_or_in_pieces(text, reasoning, answer):
    for size in (len(text) or 1, 1, 2, 3, 5):
        rs = ReasoningStream()
        got_r, got_a = "", ""
        for piece in _pieces(text, size):
            r, a = rs.feed(piece)
            got_r, got_a = got_r + r, got_a + a
        r, a = rs.close()
        got_r, got_a = got_r + r, got_a + a
        assert (got_r or None, got_a or None) == (reasoning, answer), size
        assert (rs.reasoning_text, "".join(rs.answer) or None) == (reasoning, answer)


def test_thinking_switch():
    assert thinking_enabled("qwen3", None) and thinking_enabled("deepseek_r1", {"enable_thinking": False})
    assert not thinking_enabled("qwen3", {"enable_thinking": False}) and not thinking_enabled(None, None)


def test_reasoning_then_tool_calls():
    text = '<think>I need the weather.</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    plan = plan_tools([WEATHER], "auto", None, "hermes")
    for size in (len(text), 1, 4):
        p = ReplyParser(plan, reasoning=True)
        rs, cs = "", ""
        for piece in _pieces(text, size) + [None]:
            r, c, _ = p.close() if piece is None else p.feed(piece)
            rs, cs = rs + r, cs + c
        assert (rs, cs, p.reasoning, p.content) == ("I need the weather.", "", "I need the weather.", None)
        assert [(c.name, c.arguments) for c in p.calls] == [("get_weather", '{"city": "Paris"}')]


def test_tool_parser_auto_reads_the_template():
    from tiny_models import CHATML

    assert detect_tool_parser(CHATML)[0] == "hermes"  # ChatML without tools: the bundled Hermes template
    assert detect_tool_parser("{% if tools %}<tool_call>{{ tools }}</tool_call>{% endif %}")[0] == "hermes"
    assert detect_tool_parser("<|start_header_id|>ipython<|end_header_id|>{{ '<|python_tag|>' }}")[0] == "llama3_json"
    assert detect_tool_parser(FALLBACK_CHAT_TEMPLATE)[0] is None


@pytest.fixture(scope="module")
def client(tiny_qwen3):
    from prefixkv import LLM
    from prefixkv.async_engine import AsyncEngine
    from prefixkv.server.app import BackgroundServer, ServerConfig

    llm = LLM(model=str(tiny_qwen3), dtype="float32", num_kv_blocks=128)
    engine = AsyncEngine(llm.engine)
    config = ServerConfig("t", tool_call_parser="auto", reasoning_parser="qwen3")
    with BackgroundServer(engine, config) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    engine.close()


def _stream(client, **kw):
    reasoning, content, calls, finish = "", "", [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        d = chunk.choices[0].delta
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        content += d.content or ""
        calls += [(c.function.name, c.function.arguments) for c in d.tool_calls or []]
        finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, calls, finish


def test_chat_reasoning_content_whole_and_streamed(client):
    kw = dict(model="t", messages=[{"role": "user", "content": "hi"}], max_tokens=60, temperature=0,
              extra_body={"structured_outputs": {"regex": "<think>[a-z]{4,8}</think>\n\n[a-z]{3,6}"}})
    r = client.chat.completions.create(**kw).choices[0]
    reasoning = r.message.model_extra["reasoning_content"]
    assert 4 <= len(reasoning) <= 8 and reasoning.isalpha() and r.message.content.isalpha()
    assert _stream(client, **kw) == (reasoning, r.message.content, [], r.finish_reason)
    off = dict(kw, extra_body={**kw["extra_body"], "chat_template_kwargs": {"enable_thinking": False}})
    plain = client.chat.completions.create(**off).choices[0].message
    assert plain.content.startswith("<think>") and plain.model_extra.get("reasoning_content") is None


def test_auto_tool_choice_without_a_flag(client):
    call = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,6}"\}\}\n</tool_call>'
    kw = dict(model="t", messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER], max_tokens=200,
              temperature=0, extra_body={"structured_outputs": {"regex": "<think>[a-z]{3}</think>" + call}})
    r = client.chat.completions.create(**kw).choices[0]
    assert r.finish_reason == "tool_calls" and r.message.content is None
    assert len(r.message.model_extra["reasoning_content"]) == 3
    (c,) = r.message.tool_calls
    assert c.function.name == "get_weather"
    assert _stream(client, **kw) == (r.message.model_extra["reasoning_content"], "",
                                     [("get_weather", c.function.arguments)], "tool_calls")


def _sse(raw: list[bytes]) -> list[dict]:
    import json

    out = []
    for chunk in raw:
        for event in chunk.decode().split("\n\n"):
            if event:
                name, data = event.split("\n", 1)
                body = json.loads(data[len("data: "):])
                assert name == "event: " + body["type"]
                out.append(body)
    return out


REPLY = '<think>Paris is in France.</think>\n\nSunny.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("size", [len(REPLY), 1, 7])
def test_responses_reasoning_item_then_message_then_call(size):
    """The Responses reply builder fed the reply in pieces: a reasoning item, a message, a function
    call, each opened, written and closed in order, whatever the pieces."""
    from prefixkv.server.responses import _Reply

    reply = _Reply(ReplyParser(plan_tools([WEATHER], "auto", None, "hermes"), reasoning=True))
    raw = [e for piece in _pieces(REPLY, size) for e in reply.feed(piece, final=False)] + reply.finish("completed")
    events = _sse(raw)
    assert [i["type"] for i in reply.items] == ["reasoning", "message", "function_call"]
    assert reply.items[0]["content"] == [{"type": "reasoning_text", "text": "Paris is in France."}]
    assert reply.items[1]["content"][0]["text"] == "Sunny."
    assert (reply.items[2]["name"], reply.items[2]["arguments"]) == ("get_weather", '{"city": "Paris"}')
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "Paris is in France."
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Sunny."
    opened = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    closed = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert opened == closed == [0, 1, 2] and [e["sequence_number"] for e in events] == list(range(len(events)))


@pytest.mark.parametrize("size", [len(REPLY), 1, 7])
def test_messages_thinking_block_then_text_then_tool_use(size):
    from prefixkv.server.messages import _Blocks

    blocks = _Blocks(ReplyParser(plan_tools([WEATHER], "auto", None, "hermes"), reasoning=True))
    raw = [e for piece in _pieces(REPLY, size) for e in blocks.feed(piece, final=False)] + blocks.feed("", True)
    events = _sse(raw)
    assert blocks.blocks == [{"type": "thinking", "thinking": "Paris is in France.", "signature": ""},
                             {"type": "text", "text": "Sunny."},
                             {"type": "tool_use", "id": blocks.parser.calls[0].id, "name": "get_weather",
                              "input": {"city": "Paris"}}]
    starts = [(e["index"], e["content_block"]["type"]) for e in events if e["type"] == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text"), (2, "tool_use")]
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1, 2]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "Paris is in France."
    assert "".join(d.get("partial_json", "") for d in deltas) == '{"city": "Paris"}'
