"""The pages ``prefixkv serve`` ships and the JSON route the cache view polls, over HTTP (no browser:
tests/test_browser.py drives the pages in Chromium). A tiny float64 Llama behind a real aiohttp
server on a loopback port."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from prefixkv.async_engine import AsyncEngine
from prefixkv.config import CacheConfig, EngineConfig, SchedulerConfig
from prefixkv.engine import LLMEngine
from prefixkv.sampling_params import SamplingParams
from prefixkv.server.app import BackgroundServer, ServerConfig
from prefixkv.server.webui import STATIC_DIR, TEXT_TOKENS

BLOCK_SIZE = 4
KEY = "sk-web-test"


def _engine(tiny_llama) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_llama), dtype="float64",
                                  cache=CacheConfig(block_size=BLOCK_SIZE, num_kv_blocks=256),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8)))


def get(url: str, key: str | None = None) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def post_json(url: str, body: dict, key: str | None = None) -> dict:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def server(tiny_llama):
    with BackgroundServer(AsyncEngine(_engine(tiny_llama)), ServerConfig("tiny", api_key=KEY)) as srv:
        yield srv


def summary(srv, key: str | None = KEY, **query) -> dict:
    qs = "&".join(f"{k}={v}" for k, v in query.items())
    status, _, body = get(srv.url + "/v1/cache/summary" + (f"?{qs}" if qs else ""), key)
    assert status == 200, body
    return json.loads(body)


def test_pages_and_static_files_are_served_without_the_key(server):
    for path, kind, marker in (("/", "text/html", b'id="composer"'), ("/cache", "text/html", b'id="tree"'),
                               ("/static/chat.js", "javascript", b"/v1/chat/completions"),
                               ("/static/style.css", "text/css", b".msg"),
                               ("/static/vendor/purify.min.js", "javascript", b"DOMPurify 3.5.0"),
                               ("/static/vendor/marked.LICENSE.txt", "text/plain", b"MarkedJS")):
        status, headers, body = get(server.url + path)
        assert status == 200, path
        assert kind in headers["Content-Type"] and marker in body, path
    _, headers, _ = get(server.url + "/")
    csp = headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert headers["X-Content-Type-Options"] == "nosniff"
    status, _, _ = get(server.url + "/static/../app.py")
    assert status in (403, 404)
    status, _, _ = get(server.url + "/static/")  # no directory listing
    assert status in (403, 404)


def test_every_shipped_file_is_referenced_or_a_licence():
    pages = "".join((STATIC_DIR / p).read_text() for p in ("index.html", "cache.html"))
    for f in STATIC_DIR.rglob("*"):
        if f.is_file() and f.suffix in (".js", ".css", ".svg"):
            assert f"/static/{f.relative_to(STATIC_DIR)}" in pages, f
    for lib in ("marked.umd.js", "purify.min.js"):
        assert (STATIC_DIR / "vendor" / lib).is_file()
    assert "Apache License" in (STATIC_DIR / "vendor" / "dompurify.LICENSE.txt").read_text()
    assert "MIT" in (STATIC_DIR / "vendor" / "marked.LICENSE.txt").read_text()


def test_summary_needs_the_key_and_validates_max_nodes(server):
    status, _, body = get(server.url + "/v1/cache/summary")
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    for bad in ("0", "257", "abc", "1.5"):
        status, _, body = get(server.url + f"/v1/cache/summary?max_nodes={bad}", KEY)
        err = json.loads(body)["error"]
        assert status == 400 and err["param"] == "max_nodes", bad
        assert err["message"] == f"max_nodes: must be an integer from 1 to 256, got {bad!r}"


def test_summary_counts_blocks_and_shows_no_text(server):
    prompt = "the quick brown fox jumps over the lazy dog " * 3
    out = post_json(server.url + "/v1/completions",
                    {"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0}, KEY)
    num_prompt = out["usage"]["prompt_tokens"]
    s = summary(server)
    assert s["object"] == "cache.summary" and s["model"] == "tiny" and s["block_size"] == BLOCK_SIZE
    assert s["requests"] == {"running": 0, "waiting": 0}
    dev = s["tiers"]["device"]
    assert dev["total"] == 256 and dev["in_use"] == 0
    assert dev["evictable"] == dev["cached"] == s["tree"]["num_cached_blocks"] > 0
    assert dev["free"] == 256 - dev["cached"]
    assert set(s["tiers"]) == {"device"}  # no host or disk tier configured
    # the prompt's full blocks (and the generated tokens' full blocks but the last) are cached
    assert dev["cached"] >= num_prompt // BLOCK_SIZE
    assert s["text_shown"] is False
    body = json.dumps(s)
    assert "text" not in body.replace('"text_shown"', "") and "token_ids" not in body
    assert "fox" not in body
    node = s["tree"]["root"]["children"][0]
    assert node["num_requests"] == 0 and node["num_tokens"] == node["num_blocks"] * BLOCK_SIZE


def test_summary_while_a_request_holds_blocks(tiny_llama):
    """On the engine: one request mid-decode holds its run (num_requests 1, blocks in use), and
    the text appears only when asked for."""
    engine = _engine(tiny_llama)
    prompt = list(range(3, 3 + 4 * BLOCK_SIZE + 2))  # 4 full blocks and 2 tokens
    engine.add_request("r", prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    for _ in range(2):  # the prefill, one decode: 19 tokens, 18 of them computed
        engine.step()
    s = engine.cache_summary(max_nodes=8, text_tokens=TEXT_TOKENS)
    assert s["stats"]["num_running"] == 1 and s["stats"]["num_kv_blocks_used"] == 5
    (node,) = s["tree"]["root"]["children"]
    assert node["num_blocks"] == 4 and node["num_requests"] == 1 and node["age"] == 0
    assert node["text"] == engine.tokenizer.decode(prompt[:min(TEXT_TOKENS, 4 * BLOCK_SIZE)], skip_special_tokens=False)
    assert "token_ids" not in node
    engine.abort("r")
    engine.step()
    s = engine.cache_summary()
    assert s["stats"]["num_kv_blocks_used"] == 0 and s["tree"]["root"]["children"][0]["num_requests"] == 0
    assert "text" not in s["tree"]["root"]["children"][0]
    engine.check_integrity()


def test_cache_view_text_flag_shows_the_runs_text(tiny_llama):
    with BackgroundServer(AsyncEngine(_engine(tiny_llama)), ServerConfig("tiny", cache_view_text=True)) as srv:
        prompt = "the quick brown fox jumps over the lazy dog " * 3
        post_json(srv.url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0})
        s = summary(srv, key=None, max_nodes=1)
        assert s["text_shown"] is True and s["tree"]["num_shown_nodes"] == 1
        assert s["tree"]["root"]["children"][0]["text"].startswith("the quick brown fox")


def test_cli_flag_reaches_the_server_config():
    from prefixkv.cli import build_parser, server_config_from_args

    args = build_parser().parse_args(["serve", "--cache-view-text"])
    assert server_config_from_args(args).cache_view_text is True
    assert server_config_from_args(build_parser().parse_args(["serve"])).cache_view_text is False


def test_concurrent_polls_share_one_summary_and_a_dead_engine_answers_503(tiny_llama):
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    engine = AsyncEngine(_engine(tiny_llama))
    calls = []
    run = engine.run

    async def counting_run(fn):
        calls.append(fn)
        await asyncio.sleep(0.05)  # the engine thread is busy with a step meanwhile
        return await run(fn)

    engine.run = counting_run
    with BackgroundServer(engine, ServerConfig("tiny")) as srv:
        with ThreadPoolExecutor(6) as pool:
            bodies = list(pool.map(lambda _: summary(srv, key=None), range(6)))
        assert len(calls) == 1 and all(b["tree"] == bodies[0]["tree"] for b in bodies)
        time.sleep(0.25)  # older than SUMMARY_MAX_AGE_S: the next poll asks the engine again
        summary(srv, key=None)
        assert len(calls) == 2
        asyncio.run_coroutine_threadsafe(engine.shutdown(), srv._loop).result(30)
        time.sleep(0.25)
        status, _, body = get(srv.url + "/v1/cache/summary")
        err = json.loads(body)["error"]
        assert status == 503 and err["type"] == "server_error", body
