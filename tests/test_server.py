"""The OpenAI-compatible server end to end: a real aiohttp server on a loopback port (a background
thread; one test starts ``prefixkv serve`` as a subprocess), driven by the official ``openai`` client.
The engine steps in its own process (``EngineCoreClient``), as under ``prefixkv serve``.

The tiny random-weight Llama runs in float64, where greedy decoding is exact in any batch, so a
streamed and a non-streamed greedy request must produce the same text."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from prefixkv.async_engine import AsyncEngine, EngineDeadError, RequestAbortedError
from prefixkv.config import CacheConfig, EngineConfig, SchedulerConfig
from prefixkv.engine import LLMEngine
from prefixkv.engine_core.client import EngineCoreClient
from prefixkv.sampling_params import SamplingParams
from prefixkv.server.app import BackgroundServer, ServerConfig
from sse_stream import completion_chunks

MODEL = "tiny-llama"
BLOCK_SIZE = 16
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(tiny_llama):
    engine = EngineCoreClient.launch(EngineConfig(model=str(tiny_llama), dtype="float64",
                                                  cache=CacheConfig(block_size=BLOCK_SIZE, num_kv_blocks=1024),
                                                  scheduler=SchedulerConfig(max_num_batched_tokens=512,
                                                                            max_num_seqs=64)))
    with BackgroundServer(engine, ServerConfig(MODEL)) as srv:
        yield srv
    assert engine.fatal_error is None and not engine.is_running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def metrics(server) -> dict[str, float]:
    text = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_for(cond, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def wait_idle(server, timeout: float = 10.0) -> None:
    """No request left in the engine and no KV block held (cached prefixes are free blocks)."""
    def idle():
        m = metrics(server)
        return (m["prefixkv_kv_blocks_used"] == 0 and m["prefixkv_num_requests_running"] == 0
                and m["prefixkv_num_requests_waiting"] == 0)
    wait_for(idle, timeout, "the engine to drain and free every KV block")


def chat_messages(user: str, system: str | None = None) -> list[dict]:
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": "user", "content": user}]


def stream_chat(client, **kw) -> tuple[dict[int, str], dict[int, str], list]:
    """Concatenated content and finish_reason per choice index, and the raw chunks."""
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kw))
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                assert c.index not in finish, "finish_reason sent twice"
                finish[c.index] = c.finish_reason
    return texts, finish, chunks


def stream_completion(client, **kw) -> tuple[dict[int, str], dict[int, str], list]:
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    chunks = list(client.completions.create(model=MODEL, stream=True, **kw))
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                assert c.index not in finish, "finish_reason sent twice"
                finish[c.index] = c.finish_reason
    return texts, finish, chunks


# ---------------------------------------------------------------------- basics
def test_health_and_models(server, client):
    assert json.loads(urllib.request.urlopen(server.url + "/health").read()) == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat_completion(server, client):
    messages = chat_messages("Tell me about the fox.")
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, **GREEDY)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == MODEL
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant" and choice.finish_reason == "length"
    assert isinstance(choice.message.content, str)
    prompt_ids = server.engine.tokenizer.apply_chat_template(messages)
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == len(prompt_ids) + 8
    # max_completion_tokens is the newer name and wins over max_tokens
    r2 = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, max_completion_tokens=5,
                                        **GREEDY)
    assert r2.usage.completion_tokens == 5
    assert r.choices[0].message.content.startswith(r2.choices[0].message.content)


def test_completion_string_and_token_ids(server, client):
    prompt = "The quick brown fox"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, **GREEDY)
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 10
    ids = server.engine.tokenizer.encode(prompt)
    r_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, **GREEDY)
    assert r_ids.choices[0].text == r.choices[0].text
    assert r_ids.usage.prompt_tokens == r.usage.prompt_tokens == len(ids)


def test_default_max_tokens_of_completions_is_16(client):
    r = client.completions.create(model=MODEL, prompt="hello", **GREEDY)
    assert r.usage.completion_tokens == 16


# ---------------------------------------------------------------------- streaming
def test_chat_stream_equals_non_stream(client):
    kw = dict(messages=chat_messages("Once upon a time"), max_tokens=24, **GREEDY)
    full = client.chat.completions.create(model=MODEL, **kw)
    texts, finish, chunks = stream_chat(client, stream_options={"include_usage": True}, **kw)
    assert texts == {0: full.choices[0].message.content}
    assert finish == {0: "length"}
    first = chunks[0]
    assert first.object == "chat.completion.chunk" and first.id.startswith("chatcmpl-")
    assert first.choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    last = chunks[-1]  # include_usage: a final chunk with no choices and the usage
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == full.usage.completion_tokens == 24
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_equals_non_stream(client):
    kw = dict(prompt="Paged attention keeps the KV cache", max_tokens=24, **GREEDY)
    full = client.completions.create(model=MODEL, **kw)
    texts, finish, chunks = stream_completion(client, **kw)
    assert texts == {0: full.choices[0].text}
    assert finish == {0: "length"}
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def _raw_stream(server, version: bytes, body: dict, rcvbuf: int = 0, read_after: float = 0.0) -> tuple[bytes, bytes]:
    """A streamed completion over a plain socket: the response head, and its body as sent. With
    ``rcvbuf``, a small receive buffer and nothing read for ``read_after`` seconds: a slow client."""
    import socket

    import yarl

    u = yarl.URL(server.url)
    data = json.dumps(body).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with sock:
        if rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.settimeout(60)
        sock.connect((u.host, u.port))
        sock.sendall(b"POST /v1/completions " + version + b"\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
        time.sleep(read_after)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, rest = raw.partition(b"\r\n\r\n")
    return head, rest


def _unchunk(rest: bytes) -> tuple[bytes, int]:
    """An HTTP/1.1 chunked body's data, and its number of chunks, each checked to hold whole SSE
    events and the zero chunk last."""
    sse, num_chunks = b"", 0
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        data, rest = rest[:size], rest[size:]
        assert rest[:2] == b"\r\n", (size_line, data[-40:], rest[:40])
        rest = rest[2:]
        if size == 0:
            break
        assert data.startswith(b"data: ") and data.endswith(b"\n\n"), data[:80]
        sse += data
        num_chunks += 1
    assert rest == b""
    return sse, num_chunks


def _sse_text(body: bytes) -> str:
    return "".join(c["text"] for chunk in completion_chunks(body) for c in chunk["choices"])


@pytest.fixture
def transport_writes(monkeypatch):
    """How often the server's ``_TransportWriter`` wrote, and said it could not take more."""
    from prefixkv.server import app

    seen = {"write": 0, "full": 0}
    write, writable = app._TransportWriter.write, app._TransportWriter.writable

    def counted_write(self, data):
        seen["write"] += 1
        write(self, data)

    def counted_writable(self):
        ok = writable(self)
        seen["full"] += not ok
        return ok

    monkeypatch.setattr(app._TransportWriter, "write", counted_write)
    monkeypatch.setattr(app._TransportWriter, "writable", counted_writable)
    return seen


def test_streams_are_framed_per_http_version(server, client, transport_writes):
    """A stream's chunks are written to the socket without waking its handler (serving's
    ``ChunkWriter``): HTTP/1.1 gets them as well-formed chunks (each size line its data's size, one
    SSE event or more each, the zero chunk last), HTTP/1.0 unframed until the connection closes;
    the text equals the non-streamed completion's either way."""
    body = {"model": MODEL, "prompt": "Paged attention keeps the KV cache", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, "stream": True}
    want = client.completions.create(model=MODEL, prompt=body["prompt"], max_tokens=40, **GREEDY).choices[0].text
    head, rest = _raw_stream(server, b"HTTP/1.1", body)
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
    sse, num_chunks = _unchunk(rest)
    assert num_chunks > 10 and _sse_text(sse) == want
    assert transport_writes["write"] > 0
    written = transport_writes["write"]
    head, rest = _raw_stream(server, b"HTTP/1.0", body)
    assert head.startswith(b"HTTP/1.0 200") and b"transfer-encoding" not in head.lower()
    assert rest.startswith(b"data: ") and _sse_text(rest) == want
    assert transport_writes["write"] > written


def test_a_slow_client_gets_every_token_in_order(server, client, transport_writes):
    """A client that reads nothing until its request is over, through a small receive buffer: the
    server's socket buffer (the kernel's grows to 4 MiB here) fills, the stream's writes wait and
    the steps behind them are merged; once it reads, the client gets every token of every choice,
    in order, with its logprobs, as the non-streamed greedy completion has them."""
    kw = dict(prompt="A slow reader", max_tokens=900, temperature=0, logprobs=20)
    t0 = time.monotonic()
    full = client.completions.create(model=MODEL, extra_body={"ignore_eos": True}, **kw).choices[0]
    took = time.monotonic() - t0
    n = 8  # greedy: 8 equal choices, ~5 MB of events
    head, rest = _raw_stream(server, b"HTTP/1.1", {"model": MODEL, "stream": True, "ignore_eos": True, "n": n, **kw},
                             rcvbuf=4096, read_after=2 * took + 1.0)
    assert head.startswith(b"HTTP/1.1 200")
    sse, _ = _unchunk(rest)
    events = completion_chunks(sse)
    for i in range(n):
        choices = [c for e in events for c in e["choices"] if c["index"] == i]
        assert "".join(c["text"] for c in choices) == full.text, i
        assert [t for c in choices for t in c["logprobs"]["tokens"]] == full.logprobs.tokens, i
        assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["length"], i
    assert transport_writes["full"] > 0  # the writer stopped taking bytes ...
    assert len(events) < n * 900, (took, len(sse))  # ... and steps were merged while the client did not read


def test_stream_without_usage_has_no_usage_chunk(client):
    _, _, chunks = stream_chat(client, messages=chat_messages("hi"), max_tokens=4, **GREEDY)
    assert all(c.choices for c in chunks)


# ---------------------------------------------------------------------- n > 1, batches of prompts
def test_n2_greedy_choices_equal_single(client):
    kw = dict(messages=chat_messages("Two answers please"), max_tokens=12, **GREEDY)
    one = client.chat.completions.create(model=MODEL, **kw).choices[0].message.content
    r = client.chat.completions.create(model=MODEL, n=2, **kw)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.message.content for c in r.choices] == [one, one]
    assert r.usage.completion_tokens == 24
    texts, finish, _ = stream_chat(client, n=2, **kw)
    assert texts == {0: one, 1: one} and finish == {0: "length", 1: "length"}


def test_n2_sampled(client):
    r = client.chat.completions.create(model=MODEL, messages=chat_messages("Be creative"), n=2, max_tokens=10,
                                       temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 20
    texts, finish, _ = stream_completion(client, prompt="Be creative", n=2, max_tokens=10, temperature=1.0,
                                         seed=7, extra_body={"ignore_eos": True})
    assert set(texts) == {0, 1} and finish == {0: "length", 1: "length"}


def test_completion_batch_of_prompts(client):
    prompts = ["The lazy dog", "你好，世界"]
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, **GREEDY).choices[0].text
               for p in prompts]
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [singles[0], singles[0], singles[1], singles[1]]
    assert r.usage.completion_tokens == 24
    texts, finish, _ = stream_completion(client, prompt=prompts, n=2, max_tokens=6, **GREEDY)
    assert texts == {0: singles[0], 1: singles[0], 2: singles[1], 3: singles[1]}
    assert set(finish) == {0, 1, 2, 3}


# ---------------------------------------------------------------------- stop strings
def _ascii_stop(text: str) -> str:
    """A two-character alphanumeric stop string whose first occurrence is not at the start."""
    for k in range(1, len(text) - 1):
        s = text[k:k + 2]
        if s.isascii() and s.isalnum() and text.find(s) > 0:
            return s
    pytest.skip(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(client, stream):
    kw = dict(prompt="Once upon a time there was", max_tokens=40, **GREEDY)
    text = client.completions.create(model=MODEL, **kw).choices[0].text
    stop = _ascii_stop(text)
    expected = text[:text.find(stop)]
    if stream:
        texts, finish, _ = stream_completion(client, stop=[stop, "never-seen-zz"], **kw)
        assert texts == {0: expected} and finish == {0: "stop"}
    else:
        r = client.completions.create(model=MODEL, stop=stop, **kw)
        assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"


def test_chat_stop_string(client):
    kw = dict(messages=chat_messages("Say something"), max_tokens=40, **GREEDY)
    text = client.chat.completions.create(model=MODEL, **kw).choices[0].message.content
    stop = _ascii_stop(text)
    r = client.chat.completions.create(model=MODEL, stop=[stop], **kw)
    assert r.choices[0].message.content == text[:text.find(stop)]
    assert r.choices[0].finish_reason == "stop"


# ---------------------------------------------------------------------- prefix cache
def test_cached_tokens_on_shared_system_prompt(client):
    system = f"[{uuid.uuid4().hex}] You are a careful assistant who answers every question briefly. " * 4
    first = client.chat.completions.create(model=MODEL, messages=chat_messages("What is a fox?", system),
                                           max_tokens=4, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert first.usage.prompt_tokens > 4 * BLOCK_SIZE
    second = client.chat.completions.create(model=MODEL, messages=chat_messages("And a dog?", system),
                                            max_tokens=4, **GREEDY)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % BLOCK_SIZE == 0 and cached < second.usage.prompt_tokens
    _, _, chunks = stream_chat(client, messages=chat_messages("A cat?", system), max_tokens=4,
                               stream_options={"include_usage": True}, **GREEDY)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= cached


# ---------------------------------------------------------------------- logprobs
def test_chat_logprobs(server, client):
    r = client.chat.completions.create(model=MODEL, messages=chat_messages("logprobs"), max_tokens=8,
                                       logprobs=True, top_logprobs=3, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 8
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0.0
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.top_logprobs[0].bytes == entry.bytes
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
    special = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
    raw = b"".join(bytes(e.bytes) for e in content if e.token not in special)
    assert raw.decode("utf-8", errors="replace") == r.choices[0].message.content
    # streamed logprobs: one entry per generated token, same values
    chunks = client.chat.completions.create(model=MODEL, messages=chat_messages("logprobs"), max_tokens=8,
                                            logprobs=True, top_logprobs=3, stream=True, **GREEDY)
    streamed = [e for ch in chunks for c in ch.choices if c.logprobs for e in c.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="The quick", max_tokens=6, logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 2 and max(top.values()) == pytest.approx(chosen)
    no_lp = client.completions.create(model=MODEL, prompt="The quick", max_tokens=6, **GREEDY)
    assert no_lp.choices[0].logprobs is None


# ---------------------------------------------------------------------- disconnects
def _closed_count(server) -> float:
    return metrics(server).get('prefixkv_http_requests_total{route="/v1/chat/completions",status="499"}', 0.0)


def _seconds_per_token(client) -> float:
    t0 = time.monotonic()
    client.completions.create(model=MODEL, prompt="warm", max_tokens=64, **GREEDY)
    return (time.monotonic() - t0) / 64


LONG = 900  # tokens; with a short prompt it fits the 1024-token context


def test_disconnect_mid_stream_frees_blocks(server, client):
    natural = _seconds_per_token(client) * LONG  # how long the request would run if not aborted
    wait_idle(server)
    before = _closed_count(server)
    stream = client.chat.completions.create(model=MODEL, messages=chat_messages("a long story"),
                                            max_tokens=LONG, stream=True, **GREEDY)
    it = iter(stream)
    for _ in range(4):  # role chunk + a few tokens: the request is running
        next(it)
    assert metrics(server)["prefixkv_kv_blocks_used"] > 0
    t0 = time.monotonic()
    stream.close()
    wait_idle(server, timeout=natural)
    assert time.monotonic() - t0 < natural / 2, "blocks were freed by finishing, not by the abort"
    wait_for(lambda: _closed_count(server) == before + 1, 5, "the disconnect to be counted")


def test_disconnect_non_streaming_frees_blocks(server, client):
    natural = _seconds_per_token(client) * LONG
    wait_idle(server)
    timeout = min(0.3, natural / 4)
    impatient = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)
    before = _closed_count(server)
    t0 = time.monotonic()
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(model=MODEL, messages=chat_messages("never mind"), max_tokens=LONG,
                                          **GREEDY)
    wait_idle(server, timeout=natural)
    assert time.monotonic() - t0 < natural / 2, "blocks were freed by finishing, not by the abort"
    wait_for(lambda: _closed_count(server) == before + 1, 5, "the disconnect to be counted")


# ---------------------------------------------------------------------- concurrency
def test_32_concurrent_streams_match_non_streamed(server, client):
    prompts = [f"Request number {i}: the quick brown fox" for i in range(32)]
    kw = dict(max_tokens=16, **GREEDY)

    def full(p):
        return client.completions.create(model=MODEL, prompt=p, **kw).choices[0].text

    def streamed(p):
        texts, finish, chunks = stream_completion(client, prompt=p, **kw)
        assert finish == {0: "length"}
        return texts[0]

    def decode_counts():
        m = metrics(server)
        return m["prefixkv_engine_decode_steps_total"], m["prefixkv_engine_decode_step_sequences_total"]

    with ThreadPoolExecutor(32) as pool:
        expected = list(pool.map(full, prompts))
        wait_idle(server)
        steps0, seqs0 = decode_counts()
        got = list(pool.map(streamed, prompts))
    assert got == expected
    wait_idle(server)
    steps1, seqs1 = decode_counts()
    # the streams really were batched together: their decode-only steps held more than one sequence on average
    # (counted by the engine, so a short batch between two reads of a gauge is not missed)
    assert steps1 > steps0 and (seqs1 - seqs0) / (steps1 - steps0) > 1


def test_metrics_after_traffic(server, client):
    client.chat.completions.create(model=MODEL, messages=chat_messages("metrics"), max_tokens=3, **GREEDY)
    m = metrics(server)
    assert m['prefixkv_http_requests_total{route="/v1/chat/completions",status="200"}'] >= 1
    assert m["prefixkv_time_to_first_token_seconds_count"] >= 1
    assert m["prefixkv_e2e_request_latency_seconds_count"] >= 1
    assert m["prefixkv_time_per_output_token_seconds_count"] >= 1
    assert m["prefixkv_kv_blocks_total"] == 1024
    assert m["prefixkv_prefix_cache_queried_tokens_total"] >= m["prefixkv_prefix_cache_hit_tokens_total"] > 0
    assert "prefixkv_preemptions_total" in m and "prefixkv_num_requests_waiting" in m
    # the engine's steps: the prompt's uncached tokens in prefill steps, 2 of the 3 tokens in decode steps
    assert 0 < m["prefixkv_engine_prefill_tokens_total"] <= (m["prefixkv_prefix_cache_queried_tokens_total"]
                                                            - m["prefixkv_prefix_cache_hit_tokens_total"])
    assert m["prefixkv_engine_decode_steps_total"] >= 2
    assert m["prefixkv_engine_decode_step_sequences_total"] >= m["prefixkv_engine_decode_steps_total"]
    assert m["prefixkv_engine_decode_step_context_tokens_total"] > m["prefixkv_engine_decode_step_sequences_total"]
    assert "prefixkv_engine_prefill_step_decode_sequences_total" in m
    assert m["prefixkv_engine_prefill_step_seconds_total"] > 0 and m["prefixkv_engine_decode_step_seconds_total"] > 0
    assert not any('status="500"' in k for k in m)
    # the names vLLM's dashboards read, beside ours
    lab = '{model_name="%s"}' % MODEL
    assert m["vllm:num_requests_running" + lab] == m["prefixkv_num_requests_running"]
    assert m["vllm:num_requests_waiting" + lab] == m["prefixkv_num_requests_waiting"]
    assert m["vllm:kv_cache_usage_perc" + lab] == m["prefixkv_kv_blocks_used"] / m["prefixkv_kv_blocks_total"]
    assert m["vllm:prefix_cache_queries_total" + lab] == m["prefixkv_prefix_cache_queried_tokens_total"]
    assert m["vllm:prefix_cache_hits_total" + lab] == m["prefixkv_prefix_cache_hit_tokens_total"]
    assert m["vllm:num_preemptions_total" + lab] == m["prefixkv_preemptions_total"]
    assert m["vllm:time_to_first_token_seconds_count" + lab] == m["prefixkv_time_to_first_token_seconds_count"]
    assert m["vllm:inter_token_latency_seconds_count" + lab] == m["prefixkv_time_per_output_token_seconds_count"]
    assert m["vllm:e2e_request_latency_seconds_count" + lab] == m["prefixkv_e2e_request_latency_seconds_count"]
    assert m["vllm:generation_tokens_total" + lab] == m["prefixkv_generation_tokens_total"]
    assert m['vllm:request_success_total{finished_reason="length",model_name="%s"}' % MODEL] >= 1


# ---------------------------------------------------------------------- the engine clients directly
def test_engine_client_api(server):
    ae = server.engine  # the server's engine, driven from this thread's own event loop
    long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)

    async def main():
        with pytest.raises(ValueError, match="^prompt:"):  # add_request's errors keep their type
            async for _ in ae.generate("too-long", [5] * 2000, SamplingParams(max_tokens=2)):
                pass
        outs = [o async for o in ae.generate("full", "hello", SamplingParams(max_tokens=5, temperature=0.0,
                                                                             ignore_eos=True))]
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert len(outs[-1].outputs[0].token_ids) == 5
        assert "".join(o.outputs[0].delta_text for o in outs) == outs[-1].outputs[0].text
        gen = ae.generate("early", "hello", long)  # the consumer stops early: the request is aborted
        await anext(gen)
        await gen.aclose()
        stream = await ae.add_request("dup", "hi", long)
        with pytest.raises(ValueError, match="^request_id:"):
            await ae.add_request("dup", "hi", long)
        await anext(stream)
        assert await ae.abort("dup")
        with pytest.raises(RequestAbortedError):
            async for _ in stream:
                pass
        assert not await ae.abort("dup")

    asyncio.run(main())
    wait_idle(server)


def test_async_engine_step_error_and_shutdown(tiny_llama):
    ae = AsyncEngine(LLMEngine(EngineConfig(model=str(tiny_llama), cache=CacheConfig(num_kv_blocks=128))))
    long = SamplingParams(max_tokens=900, ignore_eos=True)

    async def main():
        real_step = ae.engine.step

        def broken_step():
            ae.engine.step = real_step
            raise RuntimeError("boom")

        stream = await ae.add_request("a", "hi", long)
        await anext(stream)
        ae.engine.step = broken_step  # a failing step fails its requests, frees them, and the loop goes on
        with pytest.raises(RuntimeError, match="boom"):
            async for _ in stream:
                pass
        assert len([o async for o in ae.generate("b", "hi", SamplingParams(max_tokens=3))]) >= 1
        assert await ae.run(lambda engine: threading.current_thread().name) == "prefixkv-engine"
        stream = await ae.add_request("c", "hi", long)
        await anext(stream)
        await ae.shutdown()  # in-flight requests end with EngineDeadError
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await ae.add_request("d", "hi", long)
        assert not ae.is_running
        assert ae.stats()["num_kv_blocks_used"] == 0

    asyncio.run(main())


# ---------------------------------------------------------------------- the CLI process
def test_serve_subprocess_sigterm_exits_0(tiny_llama):
    env = dict(os.environ, PYTHONUNBUFFERED="1", PREFIXKV_API_KEY="k")
    proc = subprocess.Popen([sys.executable, "-m", "prefixkv.cli", "serve", "--model", str(tiny_llama),
                             "--port", "0", "--num-kv-blocks", "128", "--served-model-name", "sub"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines = []
        url = None
        deadline = time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.match(r"prefixkv serving sub at (http://127\.0\.0\.1:\d+)$", line.strip())
            url = m.group(1) if m else None
        assert url, f"no ready line; stdout={lines} stderr={proc.stderr.read() if proc.poll() is not None else ''}"
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=30)
        r = client.chat.completions.create(model="sub", messages=chat_messages("hi"), max_tokens=3, **GREEDY)
        assert r.usage.completion_tokens == 3
        # a request in flight when SIGTERM arrives is aborted, and the process still exits 0
        stream = client.chat.completions.create(model="sub", messages=chat_messages("long"), max_tokens=900,
                                                stream=True, **GREEDY)
        it = iter(stream)
        next(it)
        next(it)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        rest = []
        try:
            rest = list(it)
        except (openai.APIError, openai.APIConnectionError):
            pass
        assert sum(len(c.choices) for c in rest) < 900
        err = proc.stderr.read()
        assert "Traceback" not in err and "shutting down" in err, err
        # torch, the model and the server are out of the full collections' walks, in both processes
        core = re.search(r"engine core \d+ ready at .*, (\d+) start-up objects frozen", err)
        http = re.search(r"HTTP process \d+: (\d+) start-up objects frozen", err)
        assert core and int(core.group(1)) > 50_000 and http and int(http.group(1)) > 10_000, err
        assert "engine core: shutdown asked" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


# ---------------------------------------------------------------------- vLLM's utility routes
def _post(server, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_tokenize_detokenize_version(server):
    tok = server.engine.tokenizer
    status, body = _post(server, "/tokenize", {"prompt": "hello world", "return_token_strs": True})
    ids = tok.encode("hello world")
    assert status == 200 and body == {"count": len(ids), "max_model_len": server.engine.info.max_model_len,
                                      "tokens": ids, "token_strs": tok.convert_ids_to_tokens(ids)}
    msgs = chat_messages("hi")
    status, body = _post(server, "/tokenize", {"messages": msgs})
    assert status == 200 and body["tokens"] == tok.apply_chat_template(msgs) and body["token_strs"] is None
    status, body = _post(server, "/detokenize", {"tokens": ids})
    assert status == 200 and body == {"prompt": tok.decode(ids)}
    status, body = _post(server, "/detokenize", {"tokens": [1, 10**7]})
    assert status == 400 and body["error"]["param"] == "tokens[1]", body
    status, body = _post(server, "/tokenize", {"prompt": "a", "messages": msgs})
    assert status == 400 and body["error"]["param"] == "prompt", body
    status, body = _post(server, "/tokenize", {"prompt": "a", "bogus": 1})
    assert status == 400 and body["error"]["param"] == "bogus", body
    from prefixkv import __version__

    with urllib.request.urlopen(server.url + "/version", timeout=10) as r:
        assert json.loads(r.read()) == {"version": __version__}
