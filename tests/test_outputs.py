"""Output processing: output kinds (cumulative / delta / final_only), text built without
quadratic copying, stop strings found in the tail, merged deltas for slow consumers."""

from __future__ import annotations

import asyncio

import pytest

from prefixkv import LLM, SamplingParams
from prefixkv.output_processor import TextBuffer, find_stop
from prefixkv.outputs import merge_outputs
from prefixkv.sampling_params import MAX_STOP_STRING_CHARS


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=str(tiny_llama), block_size=4, num_kv_blocks=512)


def _run(llm, params: SamplingParams, prompt=(5, 6, 7, 8, 9)):
    eng = llm.engine
    eng.scheduler.kv.radix.reset()  # the same arithmetic each run (a prefix hit computes in another order)
    eng.add_request("r", list(prompt), params)
    outs = []
    while eng.has_unfinished():
        outs.extend(o for o in eng.step() if o.request_id == "r")
    return outs


def test_delta_outputs_carry_only_what_is_new_and_the_final_one_everything(llm):
    base = dict(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=1)
    cum = _run(llm, SamplingParams(**base))
    delta = _run(llm, SamplingParams(**base, output_kind="delta"))
    assert len(cum) == len(delta) == 40
    final_c, final_d = cum[-1].outputs[0], delta[-1].outputs[0]
    assert final_d.token_ids == final_c.token_ids and final_d.text == final_c.text
    assert [lp.logprob for lp in final_d.token_logprobs] == [lp.logprob for lp in final_c.token_logprobs]
    for i, out in enumerate(delta[:-1]):
        co = out.outputs[0]
        assert co.token_ids == co.delta_token_ids == [final_c.token_ids[i]]  # one new token, not all
        assert len(co.token_logprobs) == len(co.delta_token_logprobs) == 1
        assert co.text == co.delta_text
    assert "".join(o.outputs[0].delta_text for o in delta) == final_c.text
    assert sum(len(o.outputs[0].delta_token_logprobs) for o in delta) == 40


def test_final_only_emits_once(llm):
    outs = _run(llm, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, output_kind="final_only"))
    assert len(outs) == 1 and outs[0].finished and len(outs[0].outputs[0].token_ids) == 12


def _chars_copied_for(num_pieces: int) -> int:
    buf = TextBuffer()
    stops = ["<|stop|>", "ab\ncd"]
    for i in range(num_pieces):
        prev = buf.length
        buf.append("word%d " % (i % 7))
        assert find_stop(buf, stops, prev) is None
        buf.tail_from(buf.length - 3)  # a delta read
    buf.value()
    return buf.num_chars_copied


def test_text_building_and_stop_search_copy_linear_amounts():
    """Characters copied per appended piece stay flat as the text grows (no text += piece)."""
    small, large = _chars_copied_for(1000), _chars_copied_for(20000)
    assert large / 20000 <= 1.2 * small / 1000, (small, large)


def test_find_stop_in_the_tail_equals_a_full_search():
    buf = TextBuffer()
    text = ""
    for piece in ["Hello", " wor", "ld! S", "TOP", " more", "STO", "P"]:
        prev = len(text)
        text += piece
        buf.append(piece)
        got = find_stop(buf, ["STOP", "world!"], prev)
        want = None
        for s in ["STOP", "world!"]:
            i = text.find(s, max(0, prev - len(s) + 1))
            if i >= 0 and (want is None or i < want[0]):
                want = (i, s)
        assert got == want, (piece, got, want)


def test_stop_strings_are_bounded():
    with pytest.raises(ValueError, match="^stop: each stop string must be at most"):
        SamplingParams(stop=["x" * (MAX_STOP_STRING_CHARS + 1)])
    with pytest.raises(ValueError, match="^stop: at most 16"):
        SamplingParams(stop=[f"s{i}" for i in range(17)])
    with pytest.raises(ValueError, match="^output_kind:"):
        SamplingParams(output_kind="streaming")


def test_merged_deltas_equal_the_ones_they_replace(llm):
    outs = _run(llm, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=0,
                                    output_kind="delta"))
    merged = outs[0]
    for o in outs[1:5]:
        merged = merge_outputs(merged, o, delta=True)
    co = merged.outputs[0]
    assert co.token_ids == co.delta_token_ids == [t for o in outs[:5] for t in o.outputs[0].token_ids]
    assert co.text == "".join(o.outputs[0].text for o in outs[:5])
    final = merged
    for o in outs[5:]:
        final = merge_outputs(final, o, delta=True)
    assert final.finished and final.outputs[0].token_ids == outs[-1].outputs[0].token_ids  # the full list
    assert final.outputs[0].delta_token_ids == outs[-1].outputs[0].token_ids  # every delta, in order
    assert len(final.outputs[0].delta_token_logprobs) == 20


def test_slow_consumer_gets_merged_outputs(tiny_llama):
    """An AsyncEngine consumer that reads after the request finished gets one merged output."""
    from prefixkv.async_engine import AsyncEngine
    from prefixkv.engine import LLMEngine
    from prefixkv.config import CacheConfig, EngineConfig

    async def main():
        engine = AsyncEngine(LLMEngine(EngineConfig(model=str(tiny_llama), cache=CacheConfig(block_size=4,
                                                                                            num_kv_blocks=256))))
        try:
            stream = await engine.add_request("slow", [5, 6, 7], SamplingParams(
                max_tokens=30, temperature=0.0, ignore_eos=True, output_kind="delta"))
            while engine.engine.has_unfinished():  # added (the command ran): wait until it finished
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            got = [out async for out in stream]
        finally:
            await engine.shutdown()
        return got

    got = asyncio.run(main())
    assert len(got) <= 2 and got[-1].finished
    assert sum(len(o.outputs[0].delta_token_ids) for o in got) == 30
    assert len(got[-1].outputs[0].token_ids) == 30


def test_server_refuses_an_overlong_stop_string_naming_the_field(tiny_llama):
    import openai

    from prefixkv.async_engine import AsyncEngine
    from prefixkv.config import CacheConfig, EngineConfig
    from prefixkv.engine import LLMEngine
    from prefixkv.server.app import BackgroundServer, ServerConfig

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), cache=CacheConfig(block_size=4, num_kv_blocks=64)))
    with BackgroundServer(AsyncEngine(engine), ServerConfig("m")) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="m", prompt="hi", max_tokens=2, stop=["x" * (MAX_STOP_STRING_CHARS + 1)])
        assert err.value.status_code == 400 and err.value.body["param"] == "stop"
        assert err.value.body["message"].startswith("stop: each stop string must be at most 1024 characters")


# ---------------------------------------------------------------------- stream interval
def _token_counts(outs, k: int = 0) -> list[int]:
    """Sample ``k``'s tokens so far at each output (delta outputs)."""
    counts, n = [], 0
    for o in outs:
        n += len(o.outputs[k].delta_token_ids) if k < len(o.outputs) else 0
        counts.append(n)
    return counts


def test_a_stream_interval_sends_the_first_token_then_every_n_and_the_finish(llm):
    base = dict(max_tokens=11, temperature=0.0, ignore_eos=True, logprobs=1, output_kind="delta")
    every = _run(llm, SamplingParams(**base))
    outs = _run(llm, SamplingParams(**base, stream_interval=4))
    assert _token_counts(outs) == [1, 5, 9, 11]
    assert [o.finished for o in outs] == [False, False, False, True]
    final, final_every = outs[-1].outputs[0], every[-1].outputs[0]
    assert final.token_ids == final_every.token_ids and final.text == final_every.text
    assert [lp.logprob for lp in final.token_logprobs] == [lp.logprob for lp in final_every.token_logprobs]
    assert "".join(o.outputs[0].delta_text for o in outs) == final_every.text
    assert [len(o.outputs[0].delta_token_logprobs) for o in outs] == [1, 4, 4, 2]
    cumulative = _run(llm, SamplingParams(**{**base, "output_kind": "cumulative"}, stream_interval=4))
    assert [len(o.outputs[0].token_ids) for o in cumulative] == [1, 5, 9, 11]
    assert cumulative[-1].outputs[0].text == final_every.text


def test_a_sample_that_finishes_is_sent_at_once_under_a_stream_interval(llm):
    """n = 3 with a stop string: each sample's finish goes out in the step it finished (the other
    samples' tokens then are what the every-step run had at its finish), and each sample's deltas
    add up to the every-step run's text; no sample holds more than the interval."""
    base = dict(n=3, max_tokens=24, temperature=1.0, seed=11, ignore_eos=True, output_kind="delta")
    free = _run(llm, SamplingParams(**base))[-1].outputs
    stop = next(c for c in free[0].text[3:] if c.isalnum() and all(c in co.text for co in free))
    every = _run(llm, SamplingParams(**base, stop=[stop]))
    outs = _run(llm, SamplingParams(**base, stop=[stop], stream_interval=6))
    assert len(outs) < len(every)

    def at_finish(run):  # sample -> every sample's token count at its first output with a finish
        counts = [_token_counts(run, k) for k in range(3)]
        got = {}
        for i, o in enumerate(run):
            for co in o.outputs:
                if co.finish_reason is not None and co.index not in got:
                    got[co.index] = [c[i] for c in counts]
        return got

    finishes = at_finish(every)
    assert sorted(finishes) == [0, 1, 2] and len({tuple(v) for v in finishes.values()}) >= 2  # not all at once
    assert at_finish(outs) == finishes
    for k in range(3):
        assert "".join(o.outputs[k].delta_text for o in outs if k < len(o.outputs)) == every[-1].outputs[k].text
        assert max(len(o.outputs[k].delta_token_ids) for o in outs if k < len(o.outputs)) <= 6


def test_the_engine_stream_interval_is_the_least_a_request_gets(tiny_llama):
    eng = LLM(model=str(tiny_llama), block_size=4, num_kv_blocks=256, stream_interval=3)
    base = dict(max_tokens=10, temperature=0.0, ignore_eos=True, output_kind="delta")
    assert _token_counts(_run(eng, SamplingParams(**base))) == [1, 4, 7, 10]
    assert _token_counts(_run(eng, SamplingParams(**base, stream_interval=2))) == [1, 4, 7, 10]
    assert _token_counts(_run(eng, SamplingParams(**base, stream_interval=5))) == [1, 6, 10]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="^stream_interval:"):
            SamplingParams(stream_interval=bad)
    with pytest.raises(ValueError, match="^stream_interval:"):
        LLM(model=str(tiny_llama), stream_interval=0)


def test_on_output_is_offered_only_what_arrives_while_the_consumer_waits():
    """``RequestStream.on_output`` (streams.py) sees an output only while the consumer is parked in
    ``__anext__`` with nothing pending: not while it handles the previous one, not behind an output
    left pending (which merges with the next, in order), never an error or the finished output.
    One that raises ends the stream with its error (the request aborted) and is dropped."""
    from prefixkv.outputs import CompletionOutput, RequestOutput
    from prefixkv.streams import OutputSink, RequestStream

    def out(text: str, finished: bool = False) -> RequestOutput:
        return RequestOutput("r", None, [1], [CompletionOutput(0, [len(text)], text, "length" if finished else None,
                                                                delta_text=text, delta_token_ids=[len(text)])],
                             finished)

    async def main():
        loop = asyncio.get_running_loop()
        stream = RequestStream("r", OutputSink(loop, delta=True), lambda rid, sink: None)
        offered, got = [], []
        answer = {"t": True}

        def take(o):
            offered.append(o.outputs[0].delta_text)
            if answer["t"] == "raise":
                raise RuntimeError("a bug of the consumer")
            return answer["t"]

        stream.on_output = take
        handling = asyncio.Event()  # the consumer holds an output until this is set (a slow write)
        handling.set()

        async def consume():
            async for o in stream:
                got.append(o.outputs[0].delta_text)
                await handling.wait()
            got.append("end")

        sink = stream._sink
        sink.put(out("a"))  # the consumer has not started waiting: pending
        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0)
        assert (offered, got) == ([], ["a"])
        sink.put(out("b"))  # it waits: offered, taken
        assert (offered, got) == (["b"], ["a"])
        answer["t"] = False
        sink.put(out("c"))  # offered, refused: pending
        sink.put(out("d"))  # behind a pending output: not offered, merged with it
        assert offered == ["b", "c"]
        handling.clear()
        await asyncio.sleep(0)
        assert got == ["a", "cd"]
        answer["t"] = True
        sink.put(out("e"))  # the consumer is busy with "cd": not offered
        assert offered == ["b", "c"]
        handling.set()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert got == ["a", "cd", "e"]
        sink.put(out("g", finished=True))  # the finished output goes to the consumer
        await asyncio.wait_for(task, 10)
        assert offered == ["b", "c"] and got == ["a", "cd", "e", "g", "end"]

        aborted = []
        stream3 = RequestStream("r3", OutputSink(loop, delta=True), lambda rid, sink: aborted.append(rid))
        stream3.on_output = take
        task = asyncio.ensure_future(stream3.__anext__())
        await asyncio.sleep(0)
        answer["t"] = "raise"
        stream3._sink.put(out("f"))  # offered, raises: the stream ends with that error, the callback is gone
        assert stream3.on_output is None and offered == ["b", "c", "f"]
        with pytest.raises(RuntimeError, match="a bug of the consumer"):
            await asyncio.wait_for(task, 10)
        assert aborted == ["r3"] and stream3.done  # the engine still ran it: aborted
        stream3.abort()
        assert aborted == ["r3"]
        answer["t"] = True

        stream2 = RequestStream("r2", OutputSink(loop, delta=True), lambda rid, sink: aborted.append(rid))
        stream2.on_output = take
        task = asyncio.ensure_future(stream2.__anext__())
        await asyncio.sleep(0)
        stream2._sink.put(ValueError("the step failed"))  # an error: to the consumer
        with pytest.raises(ValueError):
            await asyncio.wait_for(task, 10)
        assert offered == ["b", "c", "f"] and aborted == ["r3"]  # the engine's own error: nothing to abort
        return "done"

    assert asyncio.run(main()) == "done"
