"""Bad input and overload: exact status codes and OpenAI-style error bodies
(``{"error": {"message", "type", "param", "code"}}``), never a 500, and the server keeps serving.
The engine steps in its own process, as under ``prefixkv serve``."""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse

import openai
import pytest

from prefixkv.config import CacheConfig, EngineConfig, SchedulerConfig
from prefixkv.engine_core.client import EngineCoreClient
from prefixkv.server.app import BackgroundServer, ServerConfig
from test_server import metrics, wait_for, wait_idle

MODEL = "tiny"
KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 64 * 1024
TIMEOUT_S = 0.3  # the timeout server's; generating to the end of the context takes longer
CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]


def _engine(tiny_llama, **sched) -> EngineCoreClient:
    """The engine as ``prefixkv serve`` runs it: in its own process."""
    return EngineCoreClient.launch(EngineConfig(model=str(tiny_llama), dtype="float32",
                                                cache=CacheConfig(block_size=16, num_kv_blocks=256),
                                                scheduler=SchedulerConfig(**sched)))


@pytest.fixture(scope="module")
def server(tiny_llama):
    config = ServerConfig(MODEL, api_key=KEY, max_body_bytes=MAX_BODY)
    with BackgroundServer(_engine(tiny_llama), config) as srv:
        yield srv


def call(server, method: str, path: str, body: object = None, headers: dict | None = None,
         chunked: bool = False) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of one raw HTTP request; ``body`` bytes are sent as they are."""
    u = urllib.parse.urlsplit(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    try:
        if chunked:
            conn.request(method, path, body=iter([data[i:i + 8192] for i in range(0, len(data), 8192)]),
                         headers=hdrs, encode_chunked=True)
        else:
            conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, (json.loads(raw) if raw else {}), dict(resp.getheaders())
    finally:
        conn.close()


def assert_error(status: int, body: dict, want_status: int, want_type: str, want_param, want_code=None):
    assert status == want_status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == want_type, err
    assert err["param"] == want_param, err
    if want_code is not None:
        assert err["code"] == want_code, err


def chat(**fields):
    return {"model": MODEL, "messages": MSGS, "max_tokens": 4, **fields}


def compl(**fields):
    return {"model": MODEL, "prompt": "hi", "max_tokens": 4, **fields}


INVALID = "invalid_request_error"
# (case id, path, body, status, type, param, code)
BAD_INPUTS = [
    ("malformed-json", CHAT, b'{"model": "tiny", "messages": [', 400, INVALID, None, None),
    ("not-json", CHAT, b"hello", 400, INVALID, None, None),
    ("empty-body", CHAT, b"", 400, INVALID, None, None),
    ("array-body", CHAT, b"[]", 400, INVALID, None, None),
    ("missing-messages", CHAT, {"model": MODEL}, 400, INVALID, "messages", None),
    ("empty-messages", CHAT, chat(messages=[]), 400, INVALID, "messages", None),
    ("messages-not-list", CHAT, chat(messages="hi"), 400, INVALID, "messages", None),
    ("message-missing-role", CHAT, chat(messages=[{"content": "x"}]), 400, INVALID, "messages[0].role", None),
    ("message-bad-role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, INVALID,
     "messages[0].role", None),
    ("message-role-type", CHAT, chat(messages=[{"role": 3, "content": "x"}]), 400, INVALID, "messages[0].role", None),
    ("message-content-type", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, INVALID,
     "messages[0].content", None),
    ("image-part", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400, INVALID,
     "messages[0].content[0].type", None),
    ("unknown-model", CHAT, chat(model="gpt-4o"), 404, INVALID, "model", "model_not_found"),
    ("model-type", CHAT, chat(model=7), 400, INVALID, "model", None),
    ("n=0", CHAT, chat(n=0), 400, INVALID, "n", None),
    ("n=1000", CHAT, chat(n=1000), 400, INVALID, "n", None),
    ("n-string", CHAT, chat(n="two"), 400, INVALID, "n", None),
    ("n-bool", CHAT, chat(n=True), 400, INVALID, "n", None),
    ("temperature=-1", CHAT, chat(temperature=-1), 400, INVALID, "temperature", None),
    ("temperature-string", CHAT, chat(temperature="hot"), 400, INVALID, "temperature", None),
    ("top_p=0", CHAT, chat(top_p=0), 400, INVALID, "top_p", None),
    ("top_k=-5", CHAT, chat(top_k=-5), 400, INVALID, "top_k", None),
    ("min_p=2", CHAT, chat(min_p=2), 400, INVALID, "min_p", None),
    ("presence_penalty=3", CHAT, chat(presence_penalty=3), 400, INVALID, "presence_penalty", None),
    ("frequency_penalty=-3", CHAT, chat(frequency_penalty=-3), 400, INVALID, "frequency_penalty", None),
    ("repetition_penalty=0", CHAT, chat(repetition_penalty=0), 400, INVALID, "repetition_penalty", None),
    ("max_tokens=0", CHAT, chat(max_tokens=0), 400, INVALID, "max_tokens", None),
    ("max_completion_tokens=0", CHAT, chat(max_completion_tokens=0), 400, INVALID, "max_completion_tokens", None),
    ("min_tokens>max_tokens", CHAT, chat(min_tokens=9), 400, INVALID, "min_tokens", None),
    ("seed-string", CHAT, chat(seed="abc"), 400, INVALID, "seed", None),
    ("seed-huge", CHAT, chat(seed=2**70), 400, INVALID, "seed", None),
    ("stop-empty", CHAT, chat(stop=""), 400, INVALID, "stop", None),
    ("stop-int", CHAT, chat(stop=5), 400, INVALID, "stop", None),
    ("stop-too-many", CHAT, chat(stop=[f"s{i}" for i in range(17)]), 400, INVALID, "stop", None),
    ("stop_token_ids-out-of-vocab", CHAT, chat(stop_token_ids=[10**6]), 400, INVALID, "stop_token_ids", None),
    ("stream-string", CHAT, chat(stream="yes"), 400, INVALID, "stream", None),
    ("stream_options-type", CHAT, chat(stream=True, stream_options={"include_usage": "x"}), 400, INVALID,
     "stream_options.include_usage", None),
    ("top_logprobs-without-logprobs", CHAT, chat(top_logprobs=2), 400, INVALID, "top_logprobs", None),
    ("top_logprobs=50", CHAT, chat(logprobs=True, top_logprobs=50), 400, INVALID, "top_logprobs", None),
    ("logprobs-int-for-chat", CHAT, chat(logprobs=3), 400, INVALID, "logprobs", None),
    ("chat-too-long", CHAT, chat(messages=[{"role": "user", "content": "fox " * 1100}]), 400, INVALID,
     "messages", None),
    ("missing-prompt", COMPL, {"model": MODEL}, 400, INVALID, "prompt", None),
    ("empty-prompt", COMPL, compl(prompt=""), 400, INVALID, "prompt", None),
    ("empty-prompt-list", COMPL, compl(prompt=[]), 400, INVALID, "prompt", None),
    ("mixed-prompt-list", COMPL, compl(prompt=[1, "a"]), 400, INVALID, "prompt", None),
    ("prompt-type", COMPL, compl(prompt={"text": "hi"}), 400, INVALID, "prompt", None),
    ("token-out-of-vocab", COMPL, compl(prompt=[1, 10**6]), 400, INVALID, "prompt", None),
    ("negative-token", COMPL, compl(prompt=[-1]), 400, INVALID, "prompt", None),
    ("prompt-too-long", COMPL, compl(prompt=[5] * 1100), 400, INVALID, "prompt", None),
    ("prompt-equals-context", COMPL, compl(prompt=[5] * 1024), 400, INVALID, "prompt", None),
    ("long-prompt-in-batch", COMPL, compl(prompt=[[5] * 4, [5] * 1100]), 400, INVALID, "prompt", None),
    ("completion-logprobs=30", COMPL, compl(logprobs=30), 400, INVALID, "logprobs", None),
    ("completion-logprobs-bool", COMPL, compl(logprobs=True), 400, INVALID, "logprobs", None),
    ("max-tokens-0-without-echo", COMPL, compl(max_tokens=0), 400, INVALID, "max_tokens", None),
    ("suffix", COMPL, compl(suffix="x"), 400, INVALID, "suffix", None),
    ("completion-n=0", COMPL, compl(n=0), 400, INVALID, "n", None),
]


@pytest.mark.parametrize("path, body, status, type_, param, code", [c[1:] for c in BAD_INPUTS],
                         ids=[c[0] for c in BAD_INPUTS])
def test_bad_input(server, path, body, status, type_, param, code):
    got_status, got, _ = call(server, "POST", path, body, AUTH)
    assert_error(got_status, got, status, type_, param, code)


def test_bad_stream_request_fails_before_streaming(server):
    status, body, headers = call(server, "POST", CHAT, chat(stream=True, n=0), AUTH)
    assert_error(status, body, 400, INVALID, "n")
    assert headers["Content-Type"].startswith("application/json")


def test_unknown_fields_are_refused_by_name(server):
    status, body, _ = call(server, "POST", CHAT, chat(user="u1", response_format={"type": "text"}), AUTH)
    assert status == 200 and body["object"] == "chat.completion"
    status, body, _ = call(server, "POST", CHAT, chat(foo=[1]), AUTH)
    assert status == 400 and body["error"]["param"] == "foo", body
    assert body["error"]["message"].startswith("foo: unknown field")
    status, body, _ = call(server, "POST", COMPL, compl(response_format={"type": "text", "bar": 1}), AUTH)
    assert status == 400 and body["error"]["param"] == "response_format.bar", body


@pytest.mark.parametrize("field, value", [("functions", [{"name": "f"}]),
                                          ("function_call", "auto"), ("guided_regex", "x"),
                                          ("truncate_prompt_tokens", 5),
                                          ("best_of", 2), ("guided_json", {"type": "object"})])
def test_unimplemented_openai_and_vllm_fields_are_refused_by_name(server, field, value):
    status, body, _ = call(server, "POST", CHAT, chat(**{field: value}), AUTH)
    assert status == 400, body
    assert body["error"] == {"message": f"{field}: is not supported by this server", "type": "invalid_request_error",
                             "param": field, "code": None}
    status, _, _ = call(server, "POST", CHAT, chat(**{field: None}), AUTH)  # null means absent
    assert status == 200


def test_nulls_mean_defaults(server):
    nulls = dict.fromkeys(["n", "stream", "stream_options", "logprobs", "top_logprobs", "stop", "temperature",
                           "top_p", "seed", "ignore_eos", "min_tokens", "user", "max_completion_tokens"])
    status, body, _ = call(server, "POST", CHAT, chat(**nulls), AUTH)
    assert status == 200 and len(body["choices"]) == 1, body
    for chat_only in ("top_logprobs", "max_completion_tokens"):  # not fields of /v1/completions
        del nulls[chat_only]
    status, body, _ = call(server, "POST", COMPL, compl(**nulls, echo=None, suffix=None), AUTH)
    assert status == 200 and len(body["choices"]) == 1, body


def test_model_may_be_omitted(server):
    body = chat()
    del body["model"]
    status, got, _ = call(server, "POST", CHAT, body, AUTH)
    assert status == 200 and got["model"] == MODEL


@pytest.mark.parametrize("method, path, status, code", [
    ("GET", "/v1/nope", 404, "not_found"),
    ("POST", "/v1/engines/tiny/completions", 404, "not_found"),
    ("GET", "/nope", 404, "not_found"),
    ("GET", "/v1/models/gpt-4o", 404, "model_not_found"),
    ("GET", CHAT, 405, "method_not_allowed"),
    ("PUT", COMPL, 405, "method_not_allowed"),
    ("DELETE", "/v1/models", 405, "method_not_allowed"),
    ("POST", "/health", 405, "method_not_allowed"),
])
def test_unknown_route_and_method(server, method, path, status, code):
    got_status, got, headers = call(server, method, path, None, AUTH)
    assert_error(got_status, got, status, INVALID, "model" if code == "model_not_found" else None, code)
    if status == 405:
        assert "Allow" in headers


@pytest.mark.parametrize("chunked", [False, True])
def test_oversized_body_413(server, chunked):
    body = json.dumps(chat(messages=[{"role": "user", "content": "x" * (MAX_BODY + 10)}])).encode()
    status, got, _ = call(server, "POST", CHAT, body, AUTH, chunked=chunked)
    assert_error(status, got, 413, INVALID, None, "request_too_large")


V1_ROUTES = [("POST", CHAT), ("POST", COMPL), ("GET", "/v1/models"), ("GET", f"/v1/models/{MODEL}"),
             ("GET", CHAT), ("DELETE", "/v1/models"), ("PUT", COMPL), ("GET", "/v1/unknown"), ("GET", "/v1"),
             ("POST", "/tokenize"), ("POST", "/detokenize")]  # (vLLM's utility routes are the model's API too)


@pytest.mark.parametrize("method, path", V1_ROUTES)
@pytest.mark.parametrize("auth", [None, "Bearer wrong", KEY, f"bearer {KEY}", f"Bearer {KEY}x", "Bearer "])
def test_auth_required_on_every_v1_route(server, method, path, auth):
    headers = {"Authorization": auth} if auth is not None else {}
    body = chat() if path == CHAT else compl()
    status, got, resp_headers = call(server, method, path, body, headers)
    assert_error(status, got, 401, INVALID, None, "invalid_api_key")
    assert resp_headers.get("WWW-Authenticate") == "Bearer"


def test_auth_accepts_the_key_and_health_metrics_are_open(server):
    assert call(server, "GET", "/v1/models", None, AUTH)[0] == 200
    assert call(server, "GET", "/health")[0] == 200
    assert call(server, "GET", "/version")[0] == 200
    assert call(server, "POST", "/tokenize", {"prompt": "hi"}, AUTH)[0] == 200
    assert metrics(server)["prefixkv_kv_blocks_total"] == 256
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


@pytest.fixture(scope="module")
def timeout_server(tiny_llama):
    with BackgroundServer(_engine(tiny_llama), ServerConfig(MODEL, request_timeout=TIMEOUT_S)) as srv:
        yield srv


def test_request_timeout_aborts(timeout_server):
    server = timeout_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=30)
    room = server.engine.info.max_model_len - 16  # to (nearly) the end of the context
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as exc:
        client.completions.create(model=MODEL, prompt="tick", max_tokens=room, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert exc.value.status_code == 504
    assert exc.value.body["type"] == "server_error" and exc.value.body["code"] == "request_timeout"
    assert TIMEOUT_S - 0.1 < time.monotonic() - t0 < TIMEOUT_S + 5
    wait_idle(server, timeout=5)
    # streaming: the stream ends with an error event instead of hanging
    stream = client.completions.create(model=MODEL, prompt="tock", max_tokens=room, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    with pytest.raises(openai.APIError, match="timeout"):
        for _ in stream:
            pass
    wait_idle(server, timeout=5)


def test_still_serving_and_never_500(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4
    texts = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=4, temperature=0, stream=True, extra_body={"ignore_eos": True})
        if c.choices)
    assert texts == r.choices[0].message.content
    m = metrics(server)
    assert not any('status="500"' in k for k in m), [k for k in m if "status=" in k]
    assert m['prefixkv_http_requests_total{route="/v1/chat/completions",status="400"}'] > 10
    assert m['prefixkv_http_requests_total{route="unmatched",status="404"}'] >= 1
    wait_idle(server)


# ---------------------------------------------------------------------- backpressure
@pytest.fixture(scope="module")
def small_server(tiny_llama):
    engine = _engine(tiny_llama, max_num_seqs=1, max_waiting_requests=1)
    with BackgroundServer(engine, ServerConfig(MODEL)) as srv:
        yield srv


def test_503_when_waiting_queue_is_full(small_server):
    srv = small_server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=30)
    greedy = dict(temperature=0, extra_body={"ignore_eos": True})
    # A runs (max_num_seqs=1), B waits, C finds the waiting queue (size 1) full
    a = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=900, stream=True, **greedy)
    it = iter(a)
    next(it)
    next(it)
    b_result = {}

    def run_b():
        b_result["r"] = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=3, **greedy)

    b = threading.Thread(target=run_b)
    b.start()
    wait_for(lambda: metrics(srv)["prefixkv_num_requests_waiting"] == 1, 10, "B to wait")
    status, body, headers = call(srv, "POST", CHAT, chat())
    assert_error(status, body, 503, "server_error", None, "overloaded")
    assert headers.get("Retry-After") == "1"
    with pytest.raises(openai.InternalServerError) as exc:
        client.completions.create(model=MODEL, prompt="c", max_tokens=2)
    assert exc.value.status_code == 503
    a.close()  # A's client goes away: its slot frees, B runs and finishes
    b.join(30)
    assert b_result["r"].usage.completion_tokens == 3
    wait_idle(srv)
    r = client.completions.create(model=MODEL, prompt="after", max_tokens=2, **greedy)
    assert r.usage.completion_tokens == 2


def test_max_tokens_beyond_the_context_is_refused_like_vllm(server):
    limit = server.engine.info.max_model_len
    status, body, _ = call(server, "POST", COMPL, compl(prompt=[5, 6, 7], max_tokens=limit), AUTH)
    assert status == 400 and body["error"]["param"] == "max_tokens", body
    assert body["error"]["message"] == (f"max_tokens: {limit} is too large: this model's maximum context length is "
                                        f"{limit} tokens and the request has 3 input tokens ({limit} > {limit} - 3)")
    status, body, _ = call(server, "POST", CHAT, chat(max_completion_tokens=10**9), AUTH)
    assert status == 400 and body["error"]["param"] == "max_completion_tokens", body
    status, body, _ = call(server, "POST", COMPL, compl(prompt=[5, 6, 7], max_tokens=limit - 3), AUTH)
    assert status == 200, body
