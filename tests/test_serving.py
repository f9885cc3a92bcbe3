"""The OpenAI layer without a transport (``server/serving.py``): what a front end other than the
aiohttp app (a Ray Serve ingress) gets — request bytes in, ``Reply`` out, SSE bytes from an
``EventStream`` whose ``aclose()`` aborts the engine's requests, started or not."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from prefixkv.async_engine import AsyncEngine
from prefixkv.config import CacheConfig, EngineConfig, SchedulerConfig
from prefixkv.engine import LLMEngine
from prefixkv.server.serving import ApiError, OpenAIServing, ServerConfig
from sse_stream import completion_chunks


def test_the_layer_imports_no_http_library():
    code = ("import sys, prefixkv.server.serving, prefixkv.server.cache_view; "
            "print(sorted(m for m in ('aiohttp', 'starlette', 'fastapi') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.fixture
def api(tiny_llama):
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(tiny_llama), dtype="float64",
                                                cache=CacheConfig(block_size=4, num_kv_blocks=128),
                                                scheduler=SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=8))))
    yield OpenAIServing(engine, ServerConfig("tiny", api_key="k"))
    asyncio.run(engine.shutdown())


def _body(**kw) -> bytes:
    return json.dumps({"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 6, "temperature": 0,
                       "ignore_eos": True, **kw}).encode()


def test_replies_streams_and_errors_without_a_transport(api):
    async def main():
        loop = asyncio.get_running_loop()
        plain = await api.completions(_body(), loop.time())
        assert plain.status == 200 and plain.stream is None and plain.content_type == "application/json"
        text = json.loads(plain.body)["choices"][0]["text"]
        streamed = await api.completions(_body(stream=True, stream_options={"include_usage": True}), loop.time())
        assert streamed.headers["Content-Type"] == "text/event-stream" and streamed.stream is not None
        raw = b"".join([chunk async for chunk in streamed.stream])
        await streamed.stream.aclose()
        chunks = completion_chunks(raw)
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text
        assert chunks[-1]["usage"]["completion_tokens"] == 6
        with pytest.raises(ApiError) as e:
            await api.completions(_body(max_tokens=-1), loop.time())
        assert e.value.status == 400 and e.value.param == "max_tokens"
        with pytest.raises(ApiError) as e:
            api.check_key("Bearer wrong")
        assert e.value.status == 401 and e.value.reply().headers == {"WWW-Authenticate": "Bearer"}
        api.check_key("Bearer k")
        assert api.needs_key("/v1/models") and not api.needs_key("/health")

    asyncio.run(main())


def test_closing_a_stream_before_reading_it_aborts_its_request(api, monkeypatch):
    from prefixkv.streams import RequestStream

    aborted = []
    real_abort = RequestStream.abort
    def abort(self):  # this engine's streams only: one of an earlier test's, collected meanwhile, aborts too
        if self._on_abort.__self__ is api.engine:
            aborted.append(self.request_id)
        real_abort(self)

    monkeypatch.setattr(RequestStream, "abort", abort)

    async def main():
        loop = asyncio.get_running_loop()
        streamed = await api.completions(_body(max_tokens=1000, stream=True), loop.time())
        assert aborted == []  # handed over to the transport, still running
        await streamed.stream.aclose()  # never iterated: a transport that failed before sending
        assert len(aborted) == 1 and aborted[0].startswith("cmpl-")
        for _ in range(100):
            stats = api.engine.stats()
            if stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["num_kv_blocks_used"] == 0:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"the request still holds the engine: {api.engine.stats()}")

    asyncio.run(main())


def test_a_text_delta_event_is_the_encoded_chunk_byte_for_byte():
    """The streaming fast path (bytes made once per choice around the text's JSON) writes exactly
    what encoding the whole chunk writes, for either endpoint, any text."""
    from prefixkv.server.serving import _ChatFormat, _CompletionFormat, _sse

    texts = [" the", "é", '"quoted" \\ back', "\n\t", "日本語", "\x00prefixkv-text\x00", "🦊", "</s>"]
    for fmt_type in (_CompletionFormat, _ChatFormat):
        fmt = fmt_type("id-1", 1796476976, "m", 0, None)
        for index in (0, 3):
            for text in texts:
                want = _sse(fmt.delta_chunk(index, text, None, 0, None))
                assert fmt.delta_event(index, text, None, 0, None) == want, (fmt_type.__name__, text)
        # a finish reason or logprobs take the whole encoder
        assert fmt.delta_event(0, "x", None, 0, "length") == _sse(fmt.delta_chunk(0, "x", None, 0, "length"))


def test_a_stream_deadline_ends_the_wait_it_falls_in_and_nothing_else():
    """One timer for a whole stream (serving.StreamDeadline): the wait it falls in raises
    TimeoutError and leaves the task uncancelled; the consumer's work between waits runs to its end,
    the next wait raises; a cancellation from elsewhere stays a cancellation."""
    from prefixkv.server.serving import StreamDeadline

    async def main():
        loop = asyncio.get_running_loop()
        never = loop.create_future()
        # the deadline falls in a wait
        timer = StreamDeadline(loop.time() + 0.05)
        assert await timer.wait(asyncio.sleep(0, "first")) == "first"
        with pytest.raises(TimeoutError):
            await timer.wait(never)
        timer.close()
        if sys.version_info >= (3, 11):
            assert asyncio.current_task().cancelling() == 0
        await asyncio.sleep(0.01)  # the task goes on: nothing is left to cancel it
        # the deadline falls between waits (a slow write): the write finishes, the next wait raises
        timer = StreamDeadline(loop.time() + 0.02)
        wrote = []
        await asyncio.sleep(0.06)
        wrote.append("chunk")
        with pytest.raises(TimeoutError):
            await timer.wait(never)
        assert wrote == ["chunk"]
        timer.close()
        # a cancellation from elsewhere during a wait is not turned into a timeout
        async def consumer():
            timer = StreamDeadline(loop.time() + 60)
            try:
                await timer.wait(never)
            finally:
                timer.close()

        task = asyncio.ensure_future(consumer())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return "done"

    assert asyncio.run(main()) == "done"


def test_http_processes_run_on_uvloop_where_it_is_installed():
    pytest.importorskip("uvloop")
    from prefixkv.server.app import run_event_loop

    async def main():
        return type(asyncio.get_running_loop()).__module__

    assert run_event_loop(main()).startswith("uvloop")


class _Transport:
    """A transport that writes without awaiting (serving.ChunkWriter) into the same list as the
    consumer of the iterator, so that the order of the two paths shows; ``writable`` answers from
    ``pattern`` in turn (True, False, ...), and records every write."""

    def __init__(self, out: list[bytes], pattern: list[bool]) -> None:
        self.out, self.pattern, self.calls, self.writes = out, pattern, 0, 0

    def writable(self) -> bool:
        self.calls += 1
        return self.pattern[(self.calls - 1) % len(self.pattern)]

    def write(self, data: bytes) -> None:
        self.writes += 1
        self.out.append(data)


def test_a_stream_with_a_transport_writer_gives_each_choice_the_same_text_in_order(api):
    """The outputs that arrive while a one-request stream waits are written through the transport's
    writer (its task is not woken), the rest through the iterator: together each choice's text and
    finish reason as the iterator alone gives them, in order, for any mix of the two (a writer that
    is sometimes full), with n > 1 and with echo."""
    async def stream(body: bytes, pattern: list[bool] | None) -> tuple[bytes, int]:
        loop = asyncio.get_running_loop()
        reply = await api.completions(body, loop.time())
        out: list[bytes] = []
        writer = None if pattern is None else _Transport(out, pattern)
        reply.stream.writer = writer
        try:
            async for chunk in reply.stream:
                out.append(chunk)
        finally:
            await reply.stream.aclose()
        return b"".join(out), 0 if writer is None else writer.writes

    def choices(raw: bytes) -> dict[int, tuple[str, list]]:  # each choice's text and finish reasons
        out: dict[int, tuple[str, list]] = {}
        for chunk in completion_chunks(raw):
            for c in chunk["choices"]:
                text, finishes = out.get(c["index"], ("", []))
                out[c["index"]] = (text + c["text"], finishes + ([c["finish_reason"]] if c["finish_reason"] else []))
        return out

    async def main():
        for kw in ({}, {"n": 2, "temperature": 1.0, "seed": 3}, {"echo": True}):
            body = _body(stream=True, max_tokens=40, **kw)
            alone, _ = await stream(body, None)
            want = choices(alone)
            assert sorted(want) == list(range(kw.get("n", 1)))
            assert all(f == ["length"] for _, f in want.values())
            for pattern in ([True], [False], [True, False], [False, False, True]):
                got, writes = await stream(body, pattern)
                assert choices(got) == want, (kw, pattern)
                if pattern == [False]:
                    assert writes == 0
                elif pattern == [True]:
                    assert writes > 0, kw  # 40 steps: the task was waiting for most of them
        return "done"

    assert asyncio.run(main()) == "done"
