"""Scheduler fuzzing on a tiny float64 model: random arrivals, prompt lengths, aborts, n, chunk
budgets, block sizes, KV budgets small enough to force preemption, and speculative drafts (partly
wrong on purpose) on some engines. Every request finishes exactly
once or is aborted, every finished output equals transformers' greedy reference, and no block is in
use at the end."""

from __future__ import annotations

import os
import random
from unittest import mock

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from prefixkv import LLM, SamplingParams
from prefixkv.spec_decode import NgramIndex

from test_lossless import hf_reference

NUM_PROMPTS = 10
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def corpus(tiny_llama):
    rng = random.Random(11)
    shared = [rng.randrange(3, 384) for _ in range(20)]
    prompts = [(shared if i % 3 == 0 else []) + [rng.randrange(3, 384) for _ in range(rng.randrange(1, 40))]
               for i in range(NUM_PROMPTS)]
    return prompts, hf_reference(tiny_llama, prompts, max_tokens=MAX_TOKENS)


_ENGINES: dict = {}


def _engine(model_dir, block_size, num_blocks, chunk, prefix, spec=0):
    key = (block_size, num_blocks, chunk, prefix, spec)
    if key not in _ENGINES:
        llm = LLM(model=str(model_dir), dtype="float64", block_size=block_size, num_kv_blocks=num_blocks,
                  max_num_batched_tokens=chunk, enable_prefix_caching=prefix, max_num_seqs=8,
                  num_speculative_tokens=spec)
        llm.engine.check_integrity_each_step = True
        _ENGINES[key] = llm.engine
    return _ENGINES[key]


@settings(max_examples=int(os.environ.get("PREFIXKV_SCHED_FUZZ_EXAMPLES", "30")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([1, 4, 16]),
    kv_tokens=st.integers(70, 300),
    chunk=st.sampled_from([5, 16, 64]),
    prefix=st.booleans(),
    spec=st.sampled_from([0, 0, 3]),
    events=st.lists(st.tuples(st.integers(0, NUM_PROMPTS - 1), st.integers(0, 6), st.sampled_from([1, 1, 2, 3]),
                              st.booleans()), min_size=1, max_size=10),
)
# always run: 4 blocks of 16 tokens for four requests without prefix sharing must preempt
@example(block_size=16, kv_tokens=64, chunk=64, prefix=False, spec=0,
         events=[(0, 0, 1, False), (3, 0, 1, False), (6, 0, 1, False), (9, 0, 2, False)])
# always run: speculative drafts (the oracle's: some right, some wrong) for two requests kept to the end
@example(block_size=4, kv_tokens=300, chunk=64, prefix=True, spec=3, events=[(1, 0, 1, False), (2, 1, 2, False)])
def test_random_traffic(tiny_llama, corpus, block_size, kv_tokens, chunk, prefix, spec, events):
    prompts, refs = corpus
    engine = _engine(tiny_llama, block_size, max(kv_tokens // block_size, 60 // block_size + 1), chunk, prefix, spec)
    with mock.patch.object(NgramIndex, "propose", _oracle(prompts, refs)):
        _run_traffic(engine, prompts, refs, events)


def _oracle(prompts, refs):
    """Speculative drafts cut from the reference outputs, every third position made wrong."""
    def propose(_index, tokens, k):
        tokens = list(tokens)
        for p, ref in zip(prompts, refs):
            n = len(p)
            if tokens[:n] == p and tokens[n:] == ref[:len(tokens) - n]:
                draft = ref[len(tokens) - n:len(tokens) - n + k]
                return [t if (len(tokens) + j) % 3 else (t + 1) % 384 for j, t in enumerate(draft)]
        raise AssertionError("a request's tokens left the reference")
    return propose


def _run_traffic(engine, prompts, refs, events):
    arrivals = {}  # step -> [(rid, prompt index, n, abort?)]
    for i, (p, step, n, abort) in enumerate(events):
        arrivals.setdefault(step, []).append((f"f{i}", p, n, abort))
    finished: dict[str, object] = {}
    aborted: set[str] = set()
    to_abort: dict[str, int] = {}
    step = 0
    while step <= 6 or engine.has_unfinished():
        for rid, p, n, abort in arrivals.get(step, []):
            engine.add_request(rid, prompts[p], SamplingParams(n=n, max_tokens=MAX_TOKENS, temperature=0.0,
                                                               ignore_eos=True))
            if abort:
                to_abort[rid] = step + 1 + (len(rid) % 3)
        for rid, when in list(to_abort.items()):
            if when == step and rid not in finished:
                assert engine.abort(rid)
                aborted.add(rid)
                del to_abort[rid]
        for out in engine.step():
            assert out.request_id not in finished and out.request_id not in aborted
            if out.finished:
                finished[out.request_id] = out
        step += 1
        assert step < 2000, "no progress"
    for i, (p, _, n, _) in enumerate(events):
        rid = f"f{i}"
        assert (rid in finished) != (rid in aborted), rid
        if rid in finished:
            out = finished[rid]
            assert len(out.outputs) == n
            assert all(o.token_ids == refs[p] for o in out.outputs), (rid, p)
    assert engine.scheduler.kv.num_used_blocks == 0
    engine.check_integrity()


def test_the_fuzzing_above_forced_preemption_and_accepted_drafts():
    assert _ENGINES, "runs after test_random_traffic"
    assert sum(e.scheduler.num_preemptions for e in _ENGINES.values()) > 0
    assert sum(e.scheduler.num_accepted_tokens for e in _ENGINES.values()) > 0
