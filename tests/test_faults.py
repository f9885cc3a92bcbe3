"""Fault injection: an exception in the runner, the sampler, the scheduler's update or the output
processing ends exactly the requests it affects (an error output each, every block freed,
``check_integrity`` holding after every step) while the others finish with their normal outputs;
a fatal (device) error kills the engine, and a server then answers 503 on /health and exits 1."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

import pytest

from prefixkv import LLM, SamplingParams
from prefixkv.errors import EngineFatalError

PROMPTS = [[5 + (i * 13 + k) % 200 for i in range(9 + 7 * k)] for k in range(5)]


def _params(n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=12, temperature=0.0 if n == 1 else 1.0, seed=3, n=n, ignore_eos=True)


@pytest.fixture(scope="module")
def clean(tiny_llama):
    """Outputs of the five requests (the third with n = 3) without faults."""
    llm = LLM(model=str(tiny_llama), dtype="float64", block_size=4, num_kv_blocks=256, max_num_batched_tokens=24,
               max_num_seqs=3)
    return _run(llm, lambda eng: None)


def _run(llm, inject, max_steps: int = 400) -> dict[str, list]:
    eng = llm.engine
    eng.check_integrity_each_step = True
    for k, p in enumerate(PROMPTS):
        eng.add_request(f"r{k}", p, _params(3 if k == 2 else 1))
    results: dict[str, list] = {}
    step = 0
    while eng.has_unfinished() and step < max_steps:
        inject_now = inject(eng) if step == 3 else None
        for out in eng.step():
            if out.finished:
                results[out.request_id] = ("error", out.error) if out.error else [o.token_ids for o in out.outputs]
        if inject_now:
            inject_now()
        step += 1
    assert not eng.has_unfinished()
    assert eng.scheduler.kv.num_used_blocks == 0
    eng.check_integrity()
    return results


def _engine(tiny_llama):
    return LLM(model=str(tiny_llama), dtype="float64", block_size=4, num_kv_blocks=256, max_num_batched_tokens=24,
               max_num_seqs=3)


def _check(results, clean, failed: set[str]):
    assert {r for r, v in results.items() if isinstance(v, tuple)} == failed
    for rid, v in results.items():
        if rid not in failed:
            assert v == clean[rid], rid  # the others' outputs are unchanged
    assert all("injected" in results[r][1] for r in failed)


def test_runner_error_ends_the_scheduled_requests_only(tiny_llama, clean):
    llm = _engine(tiny_llama)
    real = llm.engine.runner.execute
    hit: set[str] = set()

    def inject(eng):
        def broken(out):
            eng.runner.execute = real
            hit.update(s.req.request_id for s in out.scheduled)
            raise RuntimeError("injected runner failure")
        eng.runner.execute = broken
        return None

    results = _run(llm, inject)
    assert hit and hit != set(results)  # some requests were not in that step and went on
    _check(results, clean, hit)


def test_sampler_error_ends_the_scheduled_requests_only(tiny_llama, clean, monkeypatch):
    import prefixkv.runner.model_runner as mr

    llm = _engine(tiny_llama)
    real = mr.sample
    calls = {"n": 0}
    hit: set[str] = set()
    real_execute = llm.engine.runner.execute

    def execute(out):
        calls["n"] += 1
        if calls["n"] == 4:
            hit.update(s.req.request_id for s in out.scheduled if s.num_samples)
            hit.update(s.req.request_id for s in out.scheduled)
        return real_execute(out)

    def sample(*a, **k):
        if calls["n"] == 4:
            raise RuntimeError("injected sampler failure")
        return real(*a, **k)

    monkeypatch.setattr(mr, "sample", sample)
    llm.engine.runner.execute = execute
    results = _run(llm, lambda eng: None)
    _check(results, clean, hit)


def test_update_error_ends_that_request_only(tiny_llama, clean):
    llm = _engine(tiny_llama)
    sched = llm.engine.scheduler
    real = sched._update_one

    def inject(eng):
        def broken(s, toks, changed):
            if s.req.request_id == "r2" and s.num_samples:  # the n = 3 request, at its fork step
                sched._update_one = real
                real(s, toks, changed)  # forks the children, then fails half-way
                raise RuntimeError("injected update failure")
            return real(s, toks, changed)
        sched._update_one = broken
        return None

    results = _run(llm, inject)
    _check(results, clean, {"r2"})


def test_output_processing_error_ends_that_request_only(tiny_llama, clean):
    llm = _engine(tiny_llama)
    proc = llm.engine.output
    real = proc.process_tokens

    def inject(eng):
        def broken(group, seq):
            if group.request_id == "r2" and seq.sample_index == 1:
                proc.process_tokens = real
                raise RuntimeError("injected output failure")
            return real(group, seq)
        proc.process_tokens = broken
        return None

    results = _run(llm, inject)
    _check(results, clean, {"r2"})


def test_fatal_error_kills_the_engine(tiny_llama):
    llm = _engine(tiny_llama)
    eng = llm.engine
    for k, p in enumerate(PROMPTS):
        eng.add_request(f"r{k}", p, _params())
    eng.step()

    def broken(out):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")

    eng.runner.execute = broken
    with pytest.raises(EngineFatalError, match="illegal memory access"):
        eng.step()
    assert not eng.has_unfinished() and eng.scheduler.kv.num_used_blocks == 0
    eng.check_integrity()
    with pytest.raises(EngineFatalError):
        eng.step()


def test_async_engine_error_output_reaches_its_consumer_only(tiny_llama):
    from prefixkv.async_engine import AsyncEngine, RequestFailedError

    llm = _engine(tiny_llama)
    ae = AsyncEngine(llm.engine)
    proc = llm.engine.output
    real = proc.process_tokens

    def broken(group, seq):
        if group.request_id == "bad":
            raise RuntimeError("injected output failure")
        return real(group, seq)

    async def main():
        proc.process_tokens = broken
        good = await ae.add_request("good", PROMPTS[0], _params())
        bad = await ae.add_request("bad", PROMPTS[1], _params())
        with pytest.raises(RequestFailedError, match="injected"):
            async for _ in bad:
                pass
        outs = [o async for o in good]
        await ae.shutdown()
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 12


def test_a_dead_engine_is_not_running_when_its_requests_get_the_error(tiny_llama):
    """The order a client sees: once its request failed with the fatal error, ``is_running`` (what
    /health answers) is already False -- even while the engine thread has not finished winding down
    (held here at its final clean-up until the consumer has looked)."""
    import threading

    from prefixkv.async_engine import AsyncEngine

    llm = _engine(tiny_llama)
    eng = llm.engine
    looked = threading.Event()

    def broken(out):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")

    eng.runner.execute = broken
    calls = []

    class Held(AsyncEngine):
        def _finish_all(self, error):
            calls.append(type(error).__name__)
            if len(calls) == 2:  # the thread's final clean-up waits until the consumer has looked
                looked.wait(timeout=30)
            super()._finish_all(error)

    async def main():
        ae = Held(eng)
        stream = await ae.add_request("r", PROMPTS[0], _params())
        with pytest.raises(EngineFatalError):
            async for _ in stream:
                pass
        running = ae.is_running
        looked.set()
        await ae.shutdown()
        return running

    assert asyncio.run(main()) is False
    assert calls == ["EngineFatalError", "EngineDeadError"]
    assert eng.scheduler.kv.num_used_blocks == 0


SERVER_SCRIPT = textwrap.dedent("""
    import asyncio, sys
    from prefixkv.async_engine import AsyncEngine
    from prefixkv.config import CacheConfig, EngineConfig
    from prefixkv.engine import LLMEngine
    from prefixkv.server.app import ServerConfig, serve

    engine = LLMEngine(EngineConfig(model=sys.argv[1], cache=CacheConfig(block_size=4, num_kv_blocks=256)))
    real = engine.runner.execute
    steps = {"n": 0}

    def execute(out):
        steps["n"] += 1
        if steps["n"] > 5:  # the device fails mid-stream
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
        return real(out)

    engine.runner.execute = execute
    sys.exit(asyncio.run(serve(AsyncEngine(engine), ServerConfig("m"), "127.0.0.1", int(sys.argv[2]))))
""")


def test_server_with_a_dead_engine_answers_503_and_exits_1(tiny_llama, tmp_path):
    import socket
    import time
    import urllib.error
    import urllib.request
    import json

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "serve_fatal.py"
    script.write_text(SERVER_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(tiny_llama), str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    assert r.status == 200
                    break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
                time.sleep(0.2)
        body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 50, "ignore_eos": True}).encode()
        req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 503
        assert json.loads(err.value.read())["error"]["code"] == "engine_dead"
        try:  # while it winds down, /health says so (or the port is already closed)
            urllib.request.urlopen(base + "/health", timeout=2)
            pytest.fail("/health answered 200 after the engine died")
        except urllib.error.HTTPError as e:
            assert e.code == 503
        except (urllib.error.URLError, ConnectionError):
            pass
        assert proc.wait(timeout=30) == 1
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_failed_step_still_ends_its_out_of_memory_requests(tiny_llama):
    """A request the scheduler stops for lack of memory, in a step whose forward pass fails: its
    finished output is delivered too (else it would stay unfinished forever)."""
    from prefixkv.request import RequestStatus

    llm = _engine(tiny_llama)
    eng = llm.engine
    eng.add_request("oom", PROMPTS[0], _params())
    eng.add_request("run", PROMPTS[1], _params())
    real_schedule = eng.scheduler.schedule

    def schedule():
        out = real_schedule()
        victim = eng.scheduler.requests.get("oom#0")
        if victim is not None:  # as when the whole cache cannot hold it
            eng.scheduler.finish_request(victim, RequestStatus.FINISHED_LENGTH)
            out.out_of_memory.append(victim)
            out.scheduled[:] = [s for s in out.scheduled if s.req is not victim]
            out.num_decodes = sum(1 for s in out.scheduled if s.num_scheduled_tokens == 1)
        eng.scheduler.schedule = real_schedule
        return out

    def broken(out):
        eng.runner.execute = real_execute
        raise RuntimeError("injected runner failure")

    real_execute = eng.runner.execute
    eng.scheduler.schedule = schedule
    eng.runner.execute = broken
    outs = {o.request_id: o for o in eng.step()}
    assert outs["oom"].finished and outs["oom"].finish_reason == "length" and outs["oom"].error is None
    assert outs["run"].finished and outs["run"].error and "injected" in outs["run"].error
    assert not eng.has_unfinished() and eng.scheduler.kv.num_used_blocks == 0
