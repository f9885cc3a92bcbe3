"""The Ray Serve ingress without a cluster: ``OpenAIIngress`` driven with Starlette requests, its
replica handle a stand-in that calls a real ``EngineReplica`` (tiny float64 Llama) in this process.
What the cluster tests do not vary: the API key, body limits, validation at the ingress, the
replica's stream protocol, cancellation."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")
pytest.importorskip("starlette")

from starlette.requests import Request  # noqa: E402
from starlette.responses import FileResponse  # noqa: E402

from prefixkv.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from prefixkv.sampling_params import SamplingParams  # noqa: E402
from prefixkv.serve.control_log import ControlLog  # noqa: E402
from prefixkv.serve.ingress import OpenAIIngress, RemoteEngine  # noqa: E402
from prefixkv.serve.replica import EngineReplica, ReplicaRequest  # noqa: E402
from prefixkv.server.serving import ServerConfig  # noqa: E402


class _Gen:
    """What ``handle.options(stream=True).generate.remote(...)`` returns, over a local generator."""

    def __init__(self, agen) -> None:
        self._agen = agen
        self.cancelled = False

    def __anext__(self):
        return self._agen.__anext__()

    def cancel(self) -> None:
        self.cancelled = True
        asyncio.get_running_loop().create_task(self._agen.aclose())


class FakeHandle:
    def __init__(self, replica: EngineReplica) -> None:
        self.replica = replica
        self.calls: list[_Gen] = []

    def options(self, **_: object) -> FakeHandle:
        return self

    @property
    def describe(self):
        async def call():
            return self.replica.describe()
        return SimpleNamespace(remote=call)

    @property
    def generate(self):
        def remote(req: ReplicaRequest) -> _Gen:
            g = _Gen(self.replica.generate(req))
            self.calls.append(g)
            return g
        return SimpleNamespace(remote=remote)


@pytest.fixture(scope="module")
def replica(tiny_llama):
    r = EngineReplica(EngineConfig(model=str(tiny_llama), dtype="float64",
                                   cache=CacheConfig(block_size=4, num_kv_blocks=128),
                                   scheduler=SchedulerConfig(max_num_seqs=8, max_waiting_requests=4)))
    yield r
    r.engine.close()


def ingress(replica, tiny_llama, **config) -> tuple[OpenAIIngress, FakeHandle]:
    handle = FakeHandle(replica)
    return OpenAIIngress(handle, str(tiny_llama), ServerConfig("tiny", **config), "EngineReplica"), handle


def request(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
            query: str = "") -> Request:
    pending = [body]

    async def receive():
        return {"type": "http.request", "body": pending.pop() if pending else b"", "more_body": False}

    hs = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    if body:
        hs.append((b"content-length", str(len(body)).encode()))
    scope = {"type": "http", "method": method, "path": path, "headers": hs, "query_string": query.encode(),
             "server": ("test", 80), "scheme": "http", "root_path": ""}
    return Request(scope, receive)


async def call(ing: OpenAIIngress, method: str, path: str, body: dict | None = None, **headers: str):
    raw = json.dumps(body).encode() if body is not None else b""
    resp = await ing(request(method, path, raw, headers))
    if isinstance(resp, FileResponse):
        return resp.status_code, Path(resp.path).read_bytes()
    if hasattr(resp, "body_iterator"):
        return resp.status_code, b"".join([c async for c in resp.body_iterator])
    return resp.status_code, resp.body


def test_completions_through_the_remote_engine_are_the_engines(replica, tiny_llama):
    from test_lossless import hf_reference

    ing, handle = ingress(replica, tiny_llama)
    prompt = [5, 9, 14, 3, 77, 21, 8]
    status, body = asyncio.run(call(ing, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 5,
                                                                     "temperature": 0, "ignore_eos": True}))
    assert status == 200
    ref = replica.engine.tokenizer.decode(hf_reference(tiny_llama, [prompt], max_tokens=5)[0])
    assert json.loads(body)["choices"][0]["text"] == ref
    status, raw = asyncio.run(call(ing, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 5,
                                                                    "temperature": 0, "ignore_eos": True,
                                                                    "stream": True}))
    events = [e for e in raw.split(b"\n\n") if e]
    assert status == 200 and events[-1] == b"data: [DONE]"
    assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]) == ref


def test_the_replica_engine_and_the_remote_engine_are_both_engine_clients(replica, tiny_llama):
    """``OpenAIServing`` takes an ``EngineClient``: the replica's ``AsyncEngine`` and the ingress's
    ``RemoteEngine`` over it are both one, and the remote one tells the replica's facts."""
    from prefixkv.config import RuntimeInfo
    from prefixkv.server.serving import EngineClient

    ing, _ = ingress(replica, tiny_llama)
    remote = asyncio.run(ing._api()).engine
    assert isinstance(remote, RemoteEngine) and isinstance(remote, EngineClient)
    assert isinstance(replica.engine, EngineClient)
    assert isinstance(remote.info, RuntimeInfo) and remote.info == replica.engine.info
    assert remote.max_waiting_requests == replica.engine.max_waiting_requests == 4


def test_the_api_key_and_the_body_limit_hold_at_the_ingress(replica, tiny_llama):
    ing, _ = ingress(replica, tiny_llama, api_key="sekrit", max_body_bytes=200)
    status, body = asyncio.run(call(ing, "GET", "/v1/models"))
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    status, body = asyncio.run(call(ing, "GET", "/v1/models", authorization="Bearer sekrit"))
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == ["tiny"]
    # no key needed; no router in this process has seen a replica publish: not ready
    status, body = asyncio.run(call(ing, "GET", "/health"))
    assert status == 503 and json.loads(body) == {"status": "unavailable", "replicas": {}}
    status, body = asyncio.run(call(ing, "POST", "/v1/completions", {"prompt": "x" * 500},
                                    authorization="Bearer sekrit"))
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    assert asyncio.run(call(ing, "GET", "/v1/cache/summary"))[0] == 401  # a /v1 route
    status, body = asyncio.run(call(ing, "GET", "/v1/cache/summary", authorization="Bearer sekrit"))
    assert status == 503 and json.loads(body)["error"]["code"] == "not_ready"  # no digest published here
    assert asyncio.run(call(ing, "GET", "/"))[0] == 200  # the pages ask for the key themselves
    assert asyncio.run(call(ing, "GET", "/static/../pages.py"))[0] == 404


def test_bad_requests_are_refused_before_a_replica_is_called(replica, tiny_llama):
    ing, handle = ingress(replica, tiny_llama)
    status, body = asyncio.run(call(ing, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}}))
    err = json.loads(body)["error"]
    assert status == 400 and err["param"].startswith("response_format"), err
    status, body = asyncio.run(call(ing, "POST", "/v1/completions", {"prompt": "hi", "n": 0}))
    assert status == 400 and json.loads(body)["error"]["param"] == "n"
    assert handle.calls == []
    # refused by the replica (the prompt does not fit): a 400 too, nothing left running there
    status, body = asyncio.run(call(ing, "POST", "/v1/completions", {"prompt": [5] * 2000, "max_tokens": 1}))
    assert status == 400 and "prompt" in json.loads(body)["error"]["message"]
    assert replica.engine.stats()["num_running"] == 0


def test_the_replica_stream_protocol_and_cancellation(replica, tiny_llama):
    async def go():
        engine = RemoteEngine(FakeHandle(replica), replica.describe(), replica.engine.tokenizer, "EngineReplica")
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True, output_kind="delta")
        before = replica.engine.stats()["num_requests_aborted"]
        (stream,) = await engine.add_requests([("r-cancel", [4, 5, 6])], params)
        assert stream.replica_id == "local"
        first = await stream.__anext__()
        assert first.request_id == "r-cancel" and not first.finished
        stream.abort()  # the client went away
        for _ in range(100):
            await asyncio.sleep(0.02)
            if replica.engine.stats()["num_requests_aborted"] == before + 1:
                break
        assert replica.engine.stats()["num_requests_aborted"] == before + 1
        with pytest.raises(ValueError, match="prompt"):
            await engine.add_requests([("r-long", [5] * 2000)], SamplingParams(max_tokens=1))
        with pytest.raises(ValueError, match="token ids only"):
            await engine.add_requests([("r-text", "hello")], SamplingParams(max_tokens=1))

    asyncio.run(go())


def test_no_replica_answering_is_a_503_not_a_crash(replica, tiny_llama):
    class Unreachable(FakeHandle):
        @property
        def describe(self):
            async def call():
                raise RuntimeError("no replica")
            return SimpleNamespace(remote=call)

    ing = OpenAIIngress(Unreachable(replica), str(tiny_llama), ServerConfig("tiny"), "EngineReplica")
    status, body = asyncio.run(call(ing, "GET", "/v1/models"))
    assert status == 503 and json.loads(body)["error"]["code"] == "not_ready"


class FakeControlLog:
    """The ControlLog actor's handle (serve/control_log.py), its releases: ``since.remote(...)`` awaited."""

    def __init__(self, handles: list[str]) -> None:
        self.handles, self.asked = handles, []

    @property
    def since(self):
        async def remote(log_id, position):
            self.asked.append((log_id, position))
            return "log-1", len(self.handles), self.handles[position if log_id == "log-1" else 0:]
        return SimpleNamespace(remote=remote)


def test_a_replica_releases_the_logged_handles_its_requests_named(replica):
    """What the ingress logged (serve/control_log.py) is read from where the replica left off; of it,
    the replica releases in its engine only the handles its own requests named."""
    Log = FakeControlLog

    async def main():
        for handle in ("resp_mine", "resp_kept"):
            params = SamplingParams(max_tokens=2, temperature=0.0, kv_retention_ttl_s=600.0,
                                    kv_retention_handle=handle)
            items = [item async for item in replica.generate(ReplicaRequest(handle, list(range(5, 30)), params))]
            assert items[0][0] == "accepted" and items[-1].finished
        log = replica._log = Log(["resp_other", "resp_mine"])
        first = await replica.release_logged()
        again = await replica.release_logged()
        return first, again, log.asked, [await replica.engine.release_retention(h) for h in ("resp_mine", "resp_kept")]

    try:
        first, again, asked, still_held = asyncio.run(main())
    finally:
        replica._log, replica._releases_read = None, (None, 0)
    assert (first, again) == (1, 0) and asked == [(None, 0), ("log-1", 2)]
    assert still_held == [False, True]  # released by the log / not in it (released here by the check)


def test_a_handle_released_while_its_request_runs_is_released_again_when_it_ends(replica, monkeypatch):
    """A request still running (or waiting) when its handle is logged may retain its prefix after
    the release: the replica releases the handle once more when that request ends."""
    calls: list[str] = []
    real = replica.engine.release_retention

    async def spy(handle):
        calls.append(handle)
        return await real(handle)

    monkeypatch.setattr(replica.engine, "release_retention", spy)

    async def main():
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, kv_retention_ttl_s=600.0,
                                kv_retention_handle="resp_live")
        gen = replica.generate(ReplicaRequest("live", list(range(5, 30)), params))
        assert (await gen.__anext__())[0] == "accepted"
        await gen.__anext__()  # its first tokens: it runs
        replica._log = FakeControlLog(["resp_live"])
        released = await replica.release_logged()
        during = list(calls)
        rest = [out async for out in gen]
        await asyncio.gather(*replica._tasks)
        return released, during, rest[-1].finished, list(calls)

    try:
        released, during, finished, after = asyncio.run(main())
    finally:
        replica._log, replica._releases_read = None, (None, 0)
    assert (released, during, finished) == (1, ["resp_live"], True)
    assert after == ["resp_live", "resp_live"] and "resp_live" not in replica._handles


class ActorOf:
    """A Ray actor handle's shape over a local object: ``handle.method.remote(*args)`` awaited."""

    def __init__(self, obj) -> None:
        self.obj = obj

    def __getattr__(self, name: str):
        method = getattr(self.obj, name)

        async def remote(*args):
            return method(*args)
        return SimpleNamespace(remote=remote)


def test_a_replica_does_the_logged_resets_and_reports_each(replica):
    """Resets asked of the replica in the control log (POST /reset_prefix_cache at the ingress) are
    answered at its next look by one reset of its engine, reported under its id: True and the
    cache empty when idle; False and the cache kept while a request runs; a reset that does not
    name it is not its business."""
    log = ControlLog()
    rid = replica.replica_id

    async def cached() -> int:
        return len((await replica.engine.routing_digest())[0])

    async def main():
        replica._log = ActorOf(log)
        params = SamplingParams(max_tokens=2, temperature=0.0)
        items = [i async for i in replica.generate(ReplicaRequest("to-cache", list(range(40, 70)), params))]
        assert items[-1].finished and await cached() > 0
        idle = [log.ask_reset([rid])[1], log.ask_reset([rid, "other"])[1]]
        assert await replica.reset_logged() == 2 and await replica.reset_logged() == 0  # read once
        after_idle = await cached()
        # a request runs: refused, nothing dropped
        items = [i async for i in replica.generate(ReplicaRequest("again", list(range(40, 70)), params))]
        gen = replica.generate(ReplicaRequest("long", list(range(80, 100)),
                                              SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)))
        assert (await gen.__anext__())[0] == "accepted"
        await gen.__anext__()
        busy = log.ask_reset([rid])[1]
        assert await replica.reset_logged() == 1
        kept = await cached()
        rest = [out async for out in gen]
        not_mine = log.ask_reset(["other"])[1]
        return idle, after_idle, busy, kept, rest[-1].finished, not_mine, await replica.reset_logged()

    try:
        idle, after_idle, busy, kept, finished, not_mine, skipped = asyncio.run(main())
    finally:
        replica._log, replica._resets_read = None, (None, 0)
    lid = log.log_id
    assert [log.reset_reports(lid, n) for n in idle] == [{rid: True}, {rid: True}] and after_idle == 0
    assert log.reset_reports(lid, busy) == {rid: False} and kept > 0 and finished
    assert (skipped, log.reset_reports(lid, not_mine)) == (0, {})


def test_a_reset_whose_engine_call_fails_is_read_again_next_period(replica, monkeypatch):
    """The engine's reset raising (not a refusal) reports nothing and leaves the resets unread: the
    next period answers them."""
    log = ControlLog()
    rid = replica.replica_id
    real = replica.engine.reset_prefix_cache
    calls = []

    async def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the core's utility call failed")
        return await real()

    monkeypatch.setattr(replica.engine, "reset_prefix_cache", flaky)

    async def main():
        replica._log = ActorOf(log)
        number = log.ask_reset([rid])[1]
        with pytest.raises(RuntimeError):
            await replica.reset_logged()
        first = log.reset_reports(log.log_id, number)
        return number, first, await replica.reset_logged()

    try:
        number, first, answered = asyncio.run(main())
    finally:
        replica._log, replica._resets_read = None, (None, 0)
    assert (first, answered, log.reset_reports(log.log_id, number)) == ({}, 1, {rid: True})


def remote_engine(replica, tiny_llama, monkeypatch, published: dict[str, dict]) -> tuple[RemoteEngine, ControlLog]:
    """A RemoteEngine as in a Serve application (Ray reported up), its control log a local one and
    the replicas its router knows ``published`` (replica id -> stats)."""
    import ray

    from prefixkv.tokenizer import Tokenizer

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    log = ControlLog()
    engine = RemoteEngine(FakeHandle(replica), replica.describe(), Tokenizer.from_pretrained(str(tiny_llama)),
                          "EngineReplica", app_name="app", log=ActorOf(log), reset_timeout_s=5.0)
    monkeypatch.setattr(engine, "replica_stats", lambda: published)
    return engine, log


def test_the_ingress_resets_when_every_replica_has_reported(replica, tiny_llama, monkeypatch):
    """True once every running replica the router knows reported a reset; False if one refused; a
    replica that left or stopped running meanwhile is not waited for; one that never answers is a
    TimeoutError naming it, and so is no replica at all or a log made anew meanwhile."""
    import prefixkv.serve.ingress as ingress_mod

    published = {"r1": {"running": True}, "r2": {"running": True}, "r3": {"running": False}}
    engine, log = remote_engine(replica, tiny_llama, monkeypatch, published)
    monkeypatch.setattr(ingress_mod, "RESET_POLL_S", 0.01)

    async def answered(reports: dict[str, bool], then=None):
        number = log._next_reset
        task = asyncio.create_task(engine.reset_prefix_cache())
        while log._next_reset == number:  # (asked)
            await asyncio.sleep(0.01)
        asked = sorted(log._resets[number][0])
        for rid, done in reports.items():
            log.report_reset(number, rid, done)
        if then:
            then()
        return await asyncio.wait_for(task, 10), asked

    assert asyncio.run(answered({"r1": True, "r2": True})) == (True, ["r1", "r2"])  # (r3 does not run)
    assert asyncio.run(answered({"r1": True, "r2": False}))[0] is False
    assert asyncio.run(answered({"r1": True}, then=lambda: published.pop("r2")))[0] is True
    published["r2"] = {"running": True}
    assert asyncio.run(answered({"r1": True}, then=lambda: published["r2"].update(running=False)))[0] is True
    published["r2"] = {"running": True}
    engine.reset_timeout_s = 0.3
    with pytest.raises(TimeoutError, match="r2"):
        asyncio.run(answered({"r1": True}))
    with pytest.raises(TimeoutError, match="made anew"):
        asyncio.run(answered({}, then=lambda: setattr(log, "log_id", "another")))
    published.clear()
    with pytest.raises(TimeoutError, match="no engine replica"):
        asyncio.run(engine.reset_prefix_cache())


def test_reset_prefix_cache_at_the_ingress(replica, tiny_llama, monkeypatch):
    """The route at the ingress: off (403) unless enabled, parameters checked as the single-process
    server does, 409 when a replica refused, 503 naming the silent replica, 501 outside a Serve
    application, 200 when all reset."""
    outcome: dict[str, object] = {}

    async def reset(self) -> bool:
        if isinstance(outcome["value"], BaseException):
            raise outcome["value"]
        return outcome["value"]

    off, _ = ingress(replica, tiny_llama)
    on, _ = ingress(replica, tiny_llama, enable_reset_prefix_cache=True)

    def post(app, query: str = "") -> tuple[int, dict]:
        resp = asyncio.run(app(request("POST", "/reset_prefix_cache", query=query)))
        return resp.status_code, json.loads(resp.body)

    status, body = post(on)  # the real RemoteEngine, driven in-process: no Serve application
    assert status == 501 and body["error"]["code"] == "not_implemented"
    monkeypatch.setattr(RemoteEngine, "reset_prefix_cache", reset)
    outcome["value"] = True
    assert post(off)[0] == 403
    assert post(on) == (200, {"success": True})
    status, body = post(on, "frobnicate=1")
    assert status == 400 and body["error"]["param"] == "frobnicate"
    outcome["value"] = False
    status, body = post(on)
    assert status == 409 and body["error"]["code"] == "requests_running"
    outcome["value"] = TimeoutError("replica(s) r2 did not report")
    status, body = post(on)
    assert status == 503 and body["error"]["code"] == "reset_not_confirmed" and "r2" in body["error"]["message"]
