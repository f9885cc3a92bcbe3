"""The engine in its own process (prefixkv/engine_core/): the same outputs as in one process, and
the failures across the boundary -- a killed core (503s, exit status 1), a fatal step error,
client disconnects (aborted in the core: no block left), malformed messages either way (an
error, never a hang), the disk tier written at shutdown, several HTTP processes on one port."""

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

import aiohttp
import msgspec
import pytest
import zmq

from prefixkv.async_engine import AsyncEngine
from prefixkv.config import CacheConfig, EngineConfig, SchedulerConfig
from prefixkv.engine import LLMEngine
from prefixkv.engine_client import EngineClient
from prefixkv.engine_core import messages as m
from prefixkv.engine_core.client import EngineCoreClient
from prefixkv.engine_core.core import CoreFacts
from prefixkv.errors import EngineFatalError
from prefixkv.sampling_params import SamplingParams
from prefixkv.server.app import BackgroundServer, ServerConfig

MODEL = "tiny"


def _config(model, **cache) -> EngineConfig:
    return EngineConfig(model=str(model), dtype="float64",
                        cache=CacheConfig(**{"block_size": 4, "num_kv_blocks": 512, **cache}),
                        scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16))


@pytest.fixture(scope="module")
def core(tiny_llama):
    client = EngineCoreClient.launch(_config(tiny_llama))
    yield client
    client.close()
    assert client._process.exitcode == 0


@pytest.fixture(scope="module")
def server(core):
    with BackgroundServer(core, ServerConfig(MODEL, cache_view_text=True)) as srv:
        yield srv


def _wait(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _idle(client) -> bool:
    s = client.stats()
    return s["num_running"] == 0 and s["num_waiting"] == 0 and s["num_kv_blocks_used"] == 0


def test_import_prefixkv_loads_no_serving_library():
    code = ("import sys, prefixkv, prefixkv.cli; print(sorted(m for m in ('zmq', 'msgspec', 'aiohttp', 'ray') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_every_engine_is_an_engine_client(core, tiny_llama):
    pytest.importorskip("ray.serve")
    from prefixkv.serve.ingress import RemoteEngine

    ae = AsyncEngine(LLMEngine(_config(tiny_llama)))
    try:
        assert isinstance(core, EngineClient) and isinstance(ae, EngineClient)
    finally:
        ae.close()
    members = [n for n in dir(EngineClient) if not n.startswith("_")] + list(EngineClient.__annotations__)
    remote_class = set(dir(RemoteEngine))
    remote_instance = {"tokenizer", "info", "max_waiting_requests", "default_sampling"}  # set in __init__
    assert [n for n in members if n not in remote_class | remote_instance] == []


# ---------------------------------------------------------------------- the same outputs
def _stop_string(text: str) -> str:
    for k in range(2, len(text) - 2):
        s = text[k:k + 2]
        if s.isascii() and s.isalnum() and text.find(s) > 0:
            return s
    pytest.skip(f"no usable stop string in {text!r}")


async def _run(engine, prompt, params: SamplingParams, rid: str):
    outs = [o async for o in engine.generate(rid, prompt, params)]
    final = outs[-1]
    assert final.finished and not any(o.finished for o in outs[:-1])
    if params.output_kind == "delta":
        for k, co in enumerate(final.outputs):
            assert "".join(o.outputs[k].delta_text for o in outs if k < len(o.outputs)) == co.text
    return [(co.index, co.token_ids, co.text, co.finish_reason, co.stop_reason,
             None if co.token_logprobs is None else [(t.token_id, t.logprob, t.top_logprobs, t.rank)
                                                      for t in co.token_logprobs])
            for co in final.outputs], final.prompt_token_logprobs, final.prompt


def test_outputs_equal_the_in_process_engine(core, tiny_llama):
    """Stop strings (found by the client, which aborts the request in the core), held-back stop
    prefixes, n > 1, logprobs, prompt logprobs, every output kind: field for field what the
    in-process engine returns, in float64."""
    prompt = "the quick brown fox jumps over"
    ae = AsyncEngine(LLMEngine(_config(tiny_llama)))
    base = dict(temperature=0.0, ignore_eos=True, max_tokens=40)
    free = asyncio.run(_run(ae, prompt, SamplingParams(**base), "free"))[0][0]
    stop = _stop_string(free[2])
    cases = [
        dict(stop=[stop, "never-zz"], output_kind="delta"),
        dict(stop=[stop], include_stop_str_in_output=True, output_kind="cumulative"),
        dict(stop=[stop], min_tokens=30, output_kind="final_only"),
        dict(n=3, temperature=1.0, seed=11, stop=[stop], max_tokens=24, output_kind="delta"),
        dict(logprobs=3, prompt_logprobs=2, max_tokens=12, output_kind="delta"),
        dict(stop_token_ids=[free[1][5]], skip_special_tokens=False, max_tokens=30, output_kind="delta"),
        dict(detokenize=False, max_tokens=10, output_kind="delta"),
        dict(stop=[stop], stream_interval=4, output_kind="delta"),
        dict(n=2, temperature=1.0, seed=5, stop=[stop], stream_interval=3, output_kind="cumulative"),
    ]

    async def both():
        got = []
        for i, case in enumerate(cases):
            params = SamplingParams(**{**base, **case})
            got.append((await _run(ae, prompt, params, f"a{i}"), await _run(core, prompt, params, f"c{i}")))
        return got

    try:
        for case, (local, split) in zip(cases, asyncio.run(both())):
            assert split == local, case
    finally:
        ae.close()
    _wait(lambda: _idle(core), 10, "the core to finish the requests a stop string ended")


def test_the_client_api_from_another_event_loop(server, core):
    """The core's socket lives on the server's loop; a caller on its own loop gets the same API."""
    from prefixkv.errors import RequestAbortedError

    async def main():
        with pytest.raises(ValueError, match="^prompt:"):
            await core.add_request("long", [5] * 5000, SamplingParams(max_tokens=2))
        stream = await core.add_request("dup", "hi", SamplingParams(max_tokens=500, ignore_eos=True))
        with pytest.raises(ValueError, match="^request_id:"):
            await core.add_request("dup", "hi", SamplingParams(max_tokens=5))
        await anext(stream)
        assert await core.abort("dup")
        with pytest.raises(RequestAbortedError):
            async for _ in stream:
                pass
        with pytest.raises(ValueError, match="^method:"):
            await core.call("no_such_method")
        await core.call("check_integrity")

    asyncio.run(main())
    _wait(lambda: _idle(core), 10, "the aborted request's blocks to be freed")


def test_a_stream_interval_across_the_boundary(server, core):
    """The core sends a request's tokens at its first token, every ``stream_interval`` tokens and
    its finish (a consumer may see fewer outputs, merged, never other boundaries); over HTTP the
    same field (vLLM's) gives chunks on those boundaries, and 0 is a 400 naming it."""
    import openai

    async def counts(interval):
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, output_kind="delta",
                                stream_interval=interval)
        got, n = [], 0
        async for out in core.generate(f"si{interval}", "the quick brown fox", params):
            n += len(out.outputs[0].delta_token_ids)
            got.append(n)
        return got

    got = asyncio.run(counts(5))
    assert got[-1] == 12 and set(got) <= {1, 6, 11, 12}, got
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    chunks = client.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=12, temperature=0,
                                       logprobs=0, stream=True, extra_body={"stream_interval": 5, "ignore_eos": True})
    n, seen = 0, []
    for c in chunks:
        if c.choices and c.choices[0].logprobs is not None:
            n += len(c.choices[0].logprobs.tokens)
            seen.append(n)
    assert seen[-1] == 12 and set(seen) <= {1, 6, 11, 12}, seen
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       stream=True, extra_body={"stream_interval": 0})
    assert err.value.status_code == 400 and err.value.body["param"] == "stream_interval"
    assert err.value.body["message"].startswith("stream_interval: must be a positive int")


# ---------------------------------------------------------------------- disconnects
def test_a_disconnect_storm_aborts_every_request_in_the_core(server, core):
    before = core.stats()["num_requests_aborted"]
    num = 24

    async def storm():
        body = {"model": MODEL, "prompt": "tell me a very long story", "max_tokens": 900, "ignore_eos": True,
                "stream": True, "temperature": 0}
        clients = [aiohttp.ClientSession() for _ in range(num)]
        try:
            resps = await asyncio.gather(*(s.post(server.url + "/v1/completions", json=body) for s in clients))
            assert [r.status for r in resps] == [200] * num  # each is in the engine (16 run, 8 wait)
            for _ in range(100):  # until the core's published statistics show them all
                if core.stats()["num_running"] + core.stats()["num_waiting"] == num:
                    break
                await asyncio.sleep(0.02)
        finally:
            for s in clients:  # drop every connection at once
                s.connector._close()
                await s.close()

    asyncio.run(storm())
    _wait(lambda: _idle(core), 30, "every request to be aborted and its blocks freed")
    assert core.stats()["num_requests_aborted"] - before == num
    asyncio.run(core.call("check_integrity"))


def test_the_cache_view_across_the_boundary(server):
    body = json.dumps({"model": MODEL, "prompt": "a cache view prompt with some words", "max_tokens": 2}).encode()
    req = urllib.request.Request(server.url + "/v1/completions", body, {"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=30).read()
    with urllib.request.urlopen(server.url + "/v1/cache/summary?max_nodes=8", timeout=30) as r:
        summary = json.loads(r.read())
    assert summary["text_shown"] is True and summary["block_size"] == 4
    texts = [n.get("text", "") for n in summary["tree"]["root"]["children"]]
    assert any(t.startswith("a cache view") for t in texts), texts


def test_a_retention_handle_is_released_across_the_boundary(core):
    """``kv_retention_handle`` crosses with the sampling parameters; ``release_retention`` (a utility
    of the core) lets go of exactly that retention, once."""
    async def main():
        retained = lambda s: s["num_kv_blocks_retained"]  # noqa: E731
        before = retained(await core.call("stats"))
        prompt = [11 + (i * 5) % 300 for i in range(4 * 6 + 1)]  # 6 full blocks of 4
        params = SamplingParams(max_tokens=1, temperature=0.0, kv_retention_ttl_s=600.0, kv_retention_handle="resp_x")
        await _run(core, prompt, params, "held")
        held = retained(await core.call("stats"))
        released = [await core.release_retention("resp_x"), await core.release_retention("resp_x")]
        return before, held, released, retained(await core.call("stats"))

    before, held, released, after = asyncio.run(main())
    assert held == before + 6 and released == [True, False] and after == before


@pytest.mark.parametrize("where", ["core", "in-process"])
def test_the_routing_digest_across_the_boundary(core, tiny_llama, where):
    """``routing_digest`` (a utility of the core, one walk of the caches; the in-process engine's
    the same): block hash -> tier of every cached block, integer keys after MessagePack, and the
    cached blocks a retained prefix covers, until its handle is released."""
    from prefixkv.kv.tiers import TIER_DEVICE
    from prefixkv.serve.digest import prompt_block_hashes

    engine = core if where == "core" else AsyncEngine(LLMEngine(_config(tiny_llama)))

    async def main():
        prompt = [7 + (i * 11) % 300 for i in range(4 * 5 + 1)]  # 5 full blocks of 4
        params = SamplingParams(max_tokens=1, temperature=0.0, kv_retention_ttl_s=600.0, kv_retention_handle="resp_d")
        await _run(engine, prompt, params, "digest")
        held = await engine.routing_digest()
        await engine.release_retention("resp_d")
        return prompt_block_hashes(prompt, 4), held, await engine.routing_digest()

    try:
        hashes, (digest, retained), (digest_after, retained_after) = asyncio.run(main())
    finally:
        if engine is not core:
            engine.close()
    assert all(digest.get(h) == TIER_DEVICE for h in hashes) and all(type(k) is int for k in digest)
    assert set(hashes) <= set(retained) <= set(digest)
    assert not set(hashes) & set(retained_after) and all(h in digest_after for h in hashes)


# ---------------------------------------------------------------------- malformed messages
def test_malformed_messages_to_the_core_are_answered_with_an_error(core):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(core.address)
    try:
        sock.send(b"\xc1 not MessagePack")
        assert isinstance(m.CORE_DECODER.decode(sock.recv()), m.Refused)
        sock.send(msgspec.msgpack.encode(["add", 7, "not a list of requests", {}]))  # a call id, a bad body
        reply = m.CORE_DECODER.decode(sock.recv())
        assert isinstance(reply, m.Reply) and reply.call_id == 7 and reply.error_kind == "invalid"
        assert "malformed message" in reply.error
        sock.send(msgspec.msgpack.encode(["add", 8, [["x", [1, 2]]], {"temperature": "hot"}]))  # bad params
        reply = m.CORE_DECODER.decode(sock.recv())
        assert reply.call_id == 8 and reply.error_kind == "invalid" and reply.error.startswith("temperature:")
    finally:
        sock.close(0)
        ctx.term()
    out = asyncio.run(_run(core, "still serving", SamplingParams(max_tokens=3, ignore_eos=True), "after"))
    assert len(out[0][0][1]) == 3


def test_a_malformed_message_from_the_core_is_an_error_not_a_hang(tiny_llama, tmp_path):
    """A stand-in core that answers an AddRequests with garbage: the caller gets EngineFatalError
    at once, the client stops running (a server would answer 503 and exit 1)."""
    address = f"ipc://{tmp_path}/fake-core.sock"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(address)

    def fake_core():
        while True:
            identity, raw = router.recv_multipart()
            if isinstance(m.CLIENT_DECODER.decode(raw), m.AddRequests):
                router.send_multipart([identity, b"\xc1\xc1 garbage"])
                return

    t = threading.Thread(target=fake_core, daemon=True)
    t.start()
    facts = CoreFacts(model_path=str(tiny_llama), num_kv_blocks=64, max_model_len=1024, eos_token_ids=[0],
                      vocab_size=400, block_size=4, max_num_seqs=8, max_waiting_requests=8, default_sampling={},
                      threads=1, pid=os.getpid())
    client = EngineCoreClient(address, facts)

    async def main():
        t0 = time.monotonic()
        with pytest.raises(EngineFatalError, match="malformed message from the engine core"):
            await asyncio.wait_for(client.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4)), 10)
        assert time.monotonic() - t0 < 5
        assert not client.is_running and isinstance(client.fatal_error, EngineFatalError)
        with pytest.raises(EngineFatalError):
            await client.add_request("again", [1, 2], SamplingParams(max_tokens=4))
        await client.shutdown()

    try:
        asyncio.run(main())
    finally:
        t.join(5)
        router.close(0)
        ctx.term()


# ---------------------------------------------------------------------- the core ends
def fatal_after_three_steps(config: EngineConfig) -> LLMEngine:
    """An engine whose device fails at its fourth forward pass (spawned into the core: module level)."""
    engine = LLMEngine(config)
    real, steps = engine.runner.execute, [0]

    def execute(out):
        steps[0] += 1
        if steps[0] > 3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
        return real(out)

    engine.runner.execute = execute
    return engine


def test_a_fatal_step_error_crosses_the_boundary(tiny_llama):
    client = EngineCoreClient.launch(_config(tiny_llama), make_engine=fatal_after_three_steps)
    with BackgroundServer(client, ServerConfig(MODEL)) as srv:
        body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 50, "ignore_eos": True}).encode()
        req = urllib.request.Request(srv.url + "/v1/completions", body, {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 503 and json.loads(err.value.read())["error"]["code"] == "engine_dead"
        assert isinstance(client.fatal_error, EngineFatalError) and "illegal memory access" in str(client.fatal_error)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(srv.url + "/health", timeout=10)
        assert err.value.code == 503
    client.close()
    assert client._process.exitcode == 1


def _serve(tiny_llama, *extra: str) -> tuple[subprocess.Popen, str, str]:
    proc = subprocess.Popen([sys.executable, "-m", "prefixkv.cli", "serve", "--model", str(tiny_llama), "--port", "0",
                             "--num-kv-blocks", "256", "--served-model-name", MODEL, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        found = re.match(r"prefixkv serving \S+ at (http://127\.0\.0\.1:\d+)", line)
        if found:
            return proc, found.group(1), line
    proc.kill()
    raise AssertionError(f"no ready line: {proc.stderr.read()}")


def _post(url: str, body: dict, timeout: float = 30) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_killed_core_gives_503s_and_exit_status_1(tiny_llama):
    proc, url, _ = _serve(tiny_llama)
    try:
        assert _post(url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})[0] == 200
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            assert r.status == 200
        stream = urllib.request.urlopen(urllib.request.Request(
            url + "/v1/completions", json.dumps({"prompt": "a long one", "max_tokens": 900, "ignore_eos": True,
                                                 "stream": True}).encode(),
            {"Content-Type": "application/json"}), timeout=30)
        stream.readline()
        for line in proc.stderr:  # the core's pid, from its ready line
            found = re.search(r"engine core (\d+) ready", line)
            if found:
                break
        os.kill(int(found.group(1)), signal.SIGKILL)
        rest = stream.read().decode()  # the stream ends, with the error as its last event
        assert '"code":"engine_dead"' in rest.replace(" ", "") and rest.rstrip().endswith("data: [DONE]"), rest
        try:  # while the server winds down: 503s (or the port is already closed)
            status, body = _post(url + "/v1/completions", {"prompt": "hi", "max_tokens": 2}, timeout=10)
            assert status == 503 and body["error"]["code"] == "engine_dead", body
        except (urllib.error.URLError, ConnectionError):
            pass
        assert proc.wait(timeout=60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()


def test_two_http_processes_share_the_port_and_the_core(tiny_llama):
    proc, url, ready = _serve(tiny_llama, "--api-server-count", "2")
    assert "(2 HTTP processes, engine core" in ready, ready
    try:
        async def burst():
            async with aiohttp.ClientSession() as s:
                async def one(i):
                    async with s.post(url + "/v1/completions", json={"prompt": f"request {i}", "max_tokens": 4,
                                                                     "ignore_eos": True, "temperature": 0}) as r:
                        return r.status, await r.json()

                return await asyncio.gather(*(one(i) for i in range(8)))

        results = asyncio.run(burst())
        assert [s for s, _ in results] == [200] * 8
        assert all(b["usage"]["completion_tokens"] == 4 for _, b in results)
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        served = float(re.search(r'prefixkv_http_requests_total\{route="/v1/completions",status="200"\} (\S+)',
                                 text).group(1))
        assert served == 8  # both processes' counts, whichever served the scrape
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        err = proc.stderr.read()
        assert len(set(re.findall(r"HTTP process (\d+):", err))) == 2 and "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()


def test_the_disk_tier_is_written_when_the_core_stops(tiny_llama, tmp_path):
    """The core's way out writes every cached block to the disk tier; the next core finds them."""
    cfg = _config(tiny_llama, host_cache_bytes=1 << 20, disk_cache_dir=str(tmp_path), disk_cache_bytes=16 << 20)
    prompt = list(range(5, 45))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = EngineCoreClient.launch(cfg)
    out = asyncio.run(_run(first, prompt, params, "one"))
    assert first.stats()["num_disk_blocks_used"] == 0  # nothing reached the disk while running
    first.close()
    assert first._process.exitcode == 0 and len(list(tmp_path.rglob("*.kvb"))) == 10
    second = EngineCoreClient.launch(cfg)
    try:
        async def again():
            stream = await second.add_request("two", prompt, params)
            return [o async for o in stream][-1]

        final = asyncio.run(again())
        assert final.num_cached_tokens >= 36 and final.outputs[0].token_ids == out[0][0][1]
    finally:
        second.close()
