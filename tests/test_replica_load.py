"""What an engine replica reports of its load for the cost-model router (prefixkv/serve/load.py):
the engine's step counters, the measured speeds, and the prompt tokens still to compute."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from prefixkv.config import CacheConfig, EngineConfig, SchedulerConfig
from prefixkv.engine import LLMEngine
from prefixkv.kv import KVCacheCoordinator
from prefixkv.request import Request
from prefixkv.sampling_params import SamplingParams
from prefixkv.serve.load import MATCHED_WAITING, ReplicaLoad, SpeedMeter, queue_state

BS = 4


def test_the_engine_counts_prefill_tokens_and_decode_steps(tiny_llama):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), dtype="float32",
                                    cache=CacheConfig(block_size=BS, num_kv_blocks=64),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4)))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("a", list(range(5, 25)), params)  # 20 tokens: chunks of 16 and 4
    while engine.has_unfinished():
        engine.step()
    st = engine.stats()
    # the prompt's 20 tokens in two steps (the second also samples the first token), then 3 decodes
    assert (st["num_prefill_tokens"], st["num_decode_steps"]) == (20, 3)
    assert st["num_decode_step_context_tokens"] == 21 + 22 + 23  # tokens 2..4 attend to 21..23
    assert st["prefill_s"] > 0 and st["decode_s"] > 0
    engine.add_request("b", list(range(5, 25)) + [30, 31], params)  # its first 20 tokens cached: 2 computed
    while engine.has_unfinished():
        engine.step()
    st = engine.stats()
    assert (st["num_prefill_tokens"], st["num_decode_steps"]) == (22, 6)
    assert (st["num_decode_step_seqs"], st["num_prefill_step_decodes"]) == (6, 0)  # one sequence at a time
    assert st["num_decode_step_context_tokens"] == 66 + 23 + 24 + 25
    engine.add_request("c", list(range(40, 44)), params)
    engine.step()  # c's prompt and first token
    engine.add_request("d", list(range(50, 58)), params)
    while engine.has_unfinished():  # d's prompt beside c's 2nd token, then both, then d's last
        engine.step()
    st = engine.stats()
    assert (st["num_prefill_tokens"], st["num_decode_steps"]) == (34, 9)
    assert (st["num_decode_step_seqs"], st["num_prefill_step_decodes"]) == (6 + 2 + 2 + 1, 1)
    assert st["num_decode_step_context_tokens"] == 138 + (6 + 9) + (7 + 10) + 11  # c's 3rd, 4th; d's 2nd..4th


def test_the_speed_meter_decays_old_reports():
    m = SpeedMeter(decay=0.5)
    zero = {"num_prefill_tokens": 0, "prefill_s": 0.0, "num_decode_steps": 0, "decode_s": 0.0}
    assert m.update(zero) == (None, None)  # nothing measured yet
    assert m.update({**zero, "num_prefill_tokens": 1000, "prefill_s": 1.0}) == (1000.0, None)
    # the next window runs at 3000 tokens/s; the first one weighs half: (500 + 3000) / (0.5 + 1.0)
    rate, step = m.update({"num_prefill_tokens": 4000, "prefill_s": 2.0, "num_decode_steps": 10, "decode_s": 0.5})
    assert rate == pytest.approx(3500 / 1.5) and step == pytest.approx(0.05)
    # an idle window keeps the estimates (the decayed sums keep their ratio)
    assert m.update({"num_prefill_tokens": 4000, "prefill_s": 2.0, "num_decode_steps": 10, "decode_s": 0.5}) == (
        pytest.approx(3500 / 1.5), pytest.approx(0.05))


def _req(rid: str, ids: list[int], arrival: int) -> Request:
    return Request(rid, ids, SamplingParams(max_tokens=4), arrival, seed=0)


def test_queue_state_counts_what_is_left_to_compute_beyond_the_cache():
    kv = KVCacheCoordinator(num_blocks=64, block_size=BS)
    prefix = list(range(100, 112))  # 3 blocks, cached
    assert kv.allocate_slots("x", 0, 12) == []
    kv.cache_blocks("x", prefix, 12)
    kv.free("x")
    prefilling = _req("p", list(range(40)), 0)
    prefilling.num_computed_tokens = 16  # 24 left
    decoding = _req("d", list(range(10)), 1)
    decoding.token_ids.append(7)
    decoding.num_computed_tokens = 10  # one token to decode: no prefill left
    hit = _req("w1", prefix + [1, 2, 3], 2)  # 15 tokens, 12 cached: 3 to compute
    cold = _req("w2", list(range(200, 209)), 3)  # 9, none cached
    whole = _req("w3", prefix, 4)  # all 12 cached, but the block of its last token is computed again: 4
    sched = SimpleNamespace(running=[prefilling, decoding], waiting=[hit, cold, whole], kv=kv)
    assert queue_state(SimpleNamespace(scheduler=sched)) == {
        "num_running": 2, "num_waiting": 3, "num_prefill_tokens": 24 + 3 + 9 + 4}


def test_queue_state_estimates_the_queue_past_the_matched_window():
    kv = KVCacheCoordinator(num_blocks=64, block_size=BS)
    prefix = list(range(100, 108))
    assert kv.allocate_slots("x", 0, 8) == []
    kv.cache_blocks("x", prefix, 8)
    kv.free("x")
    # every waiting request: 8 cached + 8 new tokens; those past the window at the window's fraction (1/2)
    waiting = [_req(f"w{i}", prefix + [i] * 8, i) for i in range(MATCHED_WAITING + 10)]
    sched = SimpleNamespace(running=[], waiting=waiting, kv=kv)
    assert queue_state(SimpleNamespace(scheduler=sched))["num_prefill_tokens"] == 8 * len(waiting)


def test_replica_load_reads_a_published_load():
    assert ReplicaLoad.of({"digest": {}}) is None and ReplicaLoad.of({"load": None}) is None
    load = {"time": 5.0, "num_running": 2, "num_waiting": 3, "num_prefill_tokens": 70,
            "prefill_tokens_per_s": None, "decode_step_s": 0.02}
    assert ReplicaLoad.of({"load": load}) == ReplicaLoad(5.0, 5, 70, None, 0.02)
