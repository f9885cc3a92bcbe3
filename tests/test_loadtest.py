"""``tools/loadtest`` in ``make test``: a small run against ``prefixkv serve`` on a tiny random model
(48 streaming requests, 16 concurrent, 30% disconnecting at random moments) must end with no 5xx, no
lost request and no KV block in use after the drain. The tool against an in-process server shows that
no per-request state is left either. A fake server that misbehaves shows that the tool really catches
5xx, lost streams and leaked blocks."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from aiohttp import web

from prefixkv.async_engine import AsyncEngine
from prefixkv.config import CacheConfig, EngineConfig
from prefixkv.engine import LLMEngine
from prefixkv.server.app import BackgroundServer, ServerConfig

LOADTEST = Path(__file__).resolve().parent.parent / "tools" / "loadtest"


def run_loadtest(args: list[str], tmp_path: Path, timeout: float) -> tuple[int, dict, str]:
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(LOADTEST), "--json", str(out), *args], capture_output=True,
                          text=True, timeout=timeout)
    report = json.loads(out.read_text()) if out.exists() else {}
    return proc.returncode, report, proc.stderr


def test_small_run_against_tiny_model(tiny_llama, tmp_path):
    rc, report, log = run_loadtest(
        ["--spawn", "--model", str(tiny_llama), "--requests", "48", "--concurrency", "16",
         "--disconnect-fraction", "0.3", "--max-tokens", "16", "--max-seconds", "45", "--request-timeout", "40",
         "--server-log", str(tmp_path / "server.log"), "--", "--num-kv-blocks", "256", "--dtype", "float32"],
        tmp_path, timeout=110)
    assert rc == 0, log
    assert report["status_5xx"] == 0 and report["server_status_5xx"] == 0, log
    assert report["lost"] == 0 and report["errors"] == 0, log
    assert report["drained"] and report["kv_blocks_used_after_drain"] == 0, log
    assert report["completed"] + report["aborted"] == 48
    assert report["aborted"] > 0 and report["completed"] > 0, log
    # the server saw the disconnects as disconnects (499), not as errors
    assert report["server_status_counts"].get("499", 0) > 0, log
    assert report["server_tracebacks"] == 0, report["first_traceback"]
    assert report["server_exit_code"] == 0
    assert report["rss_before_kib"] > 0 and report["rss_after_kib"] > 0
    assert report["still_serving"]


def test_no_request_state_left_after_disconnects(tiny_llama, tmp_path):
    """The tool against an in-process server: after two rounds with disconnects, no per-request state is
    left anywhere (not only KV blocks), and the block pool's invariants hold."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), cache=CacheConfig(num_kv_blocks=256)))
    async_engine = AsyncEngine(engine)
    with BackgroundServer(async_engine, ServerConfig("tiny")) as srv:
        rc, report, log = run_loadtest(["--url", srv.url, "--server-pid", str(os.getpid()), "--requests", "64",
                                        "--concurrency", "16", "--rounds", "2", "--max-tokens", "16",
                                        "--max-seconds", "45"], tmp_path, timeout=90)
        assert rc == 0, log
        assert [r["lost"] for r in report["per_round"]] == [0, 0]
        assert [r["kv_blocks_used_after_drain"] for r in report["per_round"]] == [0, 0]
        assert report["server_status_counts"].get("499", 0) > 0, log
        sched = engine.scheduler

        def state():
            return (len(engine._parents), len(async_engine._sinks), len(sched.requests), len(sched.waiting),
                    len(sched.running), len(sched.kv.block_tables))

        asyncio.run(async_engine.run(lambda e: e.check_integrity()))
        assert state() == (0, 0, 0, 0, 0, 0), state()


# ---------------------------------------------------------------------- the tool catches failures
def _fake_app(blocks_used: int) -> web.Application:
    """A server that fails in the ways the tool must notice: every 4th request gets a 500, every
    4th stream ends without finish_reason and [DONE], and /metrics reports leaked blocks."""
    count = 0

    async def generate(request: web.Request) -> web.StreamResponse:
        nonlocal count
        count += 1
        await request.read()
        if count % 4 == 0:
            return web.json_response({"error": {"message": "boom", "type": "server_error", "param": None,
                                                "code": None}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"choices": [{"index": 0, "text": "x", "delta": {"content": "x"}, "finish_reason": None}]}
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if count % 4 != 1:
            chunk["choices"][0]["finish_reason"] = "length"
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def metrics(request: web.Request) -> web.Response:
        text = ("prefixkv_num_requests_running 0.0\nprefixkv_num_requests_waiting 0.0\n"
                f"prefixkv_kv_blocks_used {blocks_used}.0\nprefixkv_kv_blocks_total 64.0\n")
        return web.Response(text=text)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_post("/v1/completions", generate)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    return app


@pytest.fixture
def fake_server():
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(_fake_app(blocks_used=3))
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.run_until_complete(runner.cleanup())
    loop.close()


def test_tool_reports_5xx_lost_and_leaked_blocks(fake_server, tmp_path):
    rc, report, log = run_loadtest(["--url", fake_server, "--requests", "40", "--concurrency", "8",
                                    "--disconnect-fraction", "0", "--max-tokens", "4", "--max-seconds", "30"],
                                   tmp_path, timeout=60)
    assert rc == 1, log
    assert report["status_5xx"] > 0
    assert report["lost"] == report["errors"] > report["status_5xx"]  # 500s and truncated streams
    assert report["kv_blocks_used_after_drain"] == 3
    assert "RESULT: FAIL" in log and "leak" in log and "lost" in log


def test_tool_refuses_non_loopback_urls(tmp_path):
    rc, report, log = run_loadtest(["--url", "http://192.0.2.1:8000", "--requests", "1"], tmp_path, timeout=30)
    assert rc != 0 and report == {} and "loopback" in log
