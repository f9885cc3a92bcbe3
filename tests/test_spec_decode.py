"""Exact speculative decoding (n-gram prompt lookup): the proposer's drafts, the acceptance rule, and
the lossless contract with drafts on: greedy outputs token-identical to transformers' (float64)
whatever the drafts, the chunk budget, the block size, the prefix cache and preemption."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from prefixkv import LLM, SamplingParams
from prefixkv.request import RequestStatus
from prefixkv.spec_decode import NgramIndex, accept_greedy
from test_lossless import hf_reference, make_prompts

MAX_TOKENS = 16


# ---------------------------------------------------------------------------------------- proposer
def test_ngram_proposes_what_followed_the_latest_longest_match():
    idx = NgramIndex(1, 3)
    #        0  1  2  3  4  5  6  7  8  9
    toks = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 6, 7]
    # suffix (5?) no: suffix trigram (2, 6, 7) never occurred; bigram (6, 7) ends at 3 and 8:
    # the latest earlier occurrence is positions 6-7, followed by 1, 2, 6
    assert idx.propose(toks, 3) == [1, 2, 6]
    assert idx.propose(toks, 1) == [1]


def test_ngram_prefers_longer_ngrams_and_never_matches_the_suffix_itself():
    idx = NgramIndex(1, 3)
    toks = [1, 2, 3, 40, 9, 3, 41, 1, 2, 3]
    # trigram (1, 2, 3) occurred at 0-2 -> 40, 9, 3; the unigram 3 also occurred later (-> 41)
    assert idx.propose(toks, 3) == [40, 9, 3]
    assert NgramIndex(1, 1).propose(toks, 2) == [41, 1]
    # a suffix seen nowhere else proposes nothing
    assert NgramIndex(1, 3).propose([1, 2, 3, 4], 4) == []
    assert NgramIndex(2, 3).propose([7, 7], 4) == []  # bigram (7, 7) is only the suffix
    assert NgramIndex(1, 3).propose([7, 7], 4) == [7]  # unigram 7 at 0, followed by 7


def test_ngram_lookup_window(monkeypatch):
    import prefixkv.spec_decode as sd

    monkeypatch.setattr(sd, "MAX_WINDOW", 8)
    toks = [1, 2, 3, 4] + [9] * 10 + [1, 2]  # (1, 2) recurs 14 tokens back: outside the window
    assert sd.NgramIndex(2, 2).propose(toks, 2) == []
    monkeypatch.setattr(sd, "MAX_WINDOW", 16)
    assert sd.NgramIndex(2, 2).propose(toks, 2) == [3, 4]


def test_ngram_index_is_incremental():
    rng = random.Random(0)
    toks = [rng.randrange(6) for _ in range(40)]
    inc = NgramIndex(1, 3)
    for n in range(1, len(toks) + 1, 3):  # tokens arrive a few at a time
        assert inc.propose(toks[:n], 4) == NgramIndex(1, 3).propose(toks[:n], 4), n
    assert inc.propose(toks, 0) == []


def test_accept_greedy():
    assert accept_greedy([], [9]) == [9]
    assert accept_greedy([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all accepted + bonus
    assert accept_greedy([4, 5, 6], [4, 8, 6, 7]) == [4, 8]  # first mismatch: model's token
    assert accept_greedy([4, 5, 6], [1, 5, 6, 7]) == [1]


# ---------------------------------------------------------------------------------------- engine
class OracleDrafts:
    """Replaces the n-gram proposer with drafts cut from the reference outputs, corrupted at random
    positions, so every case (all accepted, some, none) occurs many times on a random-weight model
    (whose own outputs rarely repeat n-grams)."""

    def __init__(self, prompts, refs, p_wrong: float, seed: int = 0) -> None:
        self.seqs = [(list(p), list(r)) for p, r in zip(prompts, refs)]
        self.p_wrong = p_wrong
        self.rng = random.Random(seed)
        self.calls = 0

    def propose(self, _index, tokens, k):
        self.calls += 1
        tokens = list(tokens)
        for prompt, ref in self.seqs:
            n = len(prompt)
            if len(tokens) >= n and tokens[:n] == prompt and tokens[n:] == ref[:len(tokens) - n]:
                draft = ref[len(tokens) - n:len(tokens) - n + k]
                for j in range(len(draft)):
                    if self.rng.random() < self.p_wrong:
                        draft[j] = (draft[j] + 1 + self.rng.randrange(50)) % 384
                return draft
        raise AssertionError("a request's tokens left the reference: output already wrong")


def run(model_dir, prompts, *, k=4, chunk=512, block_size=16, prefix=True, num_kv_blocks=512,
        params=None, oracle=None, monkeypatch=None, **kw):
    if oracle is not None:
        monkeypatch.setattr(NgramIndex, "propose", lambda self, t, n: oracle.propose(self, t, n))
    llm = LLM(model=str(model_dir), dtype="float64", block_size=block_size, enable_prefix_caching=prefix,
              max_num_batched_tokens=chunk, num_kv_blocks=num_kv_blocks, num_speculative_tokens=k, **kw)
    llm.engine.check_integrity_each_step = True
    params = params or SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert llm.engine.scheduler.kv.num_used_blocks == 0, "blocks leaked after all requests ended"
    return llm, outs


@pytest.mark.parametrize("k", [1, 5])
@pytest.mark.parametrize("chunk,block_size,prefix",
                         [(512, 16, True), (512, 1, True), (7, 1, True), (32, 16, False), (13, 4, True)])
def test_drafts_never_change_greedy_output(tiny_llama, monkeypatch, k, chunk, block_size, prefix):
    # drafts only use the budget left after every request got its token: small budgets, few requests
    prompts = make_prompts(384)[:17 if chunk >= 512 else 4]
    refs = hf_reference(tiny_llama, make_prompts(384), max_tokens=MAX_TOKENS)[:len(prompts)]
    oracle = OracleDrafts(prompts, refs, p_wrong=0.25, seed=k)
    llm, outs = run(tiny_llama, prompts, k=k, chunk=chunk, block_size=block_size, prefix=prefix,
                    num_kv_blocks=4096 // block_size, oracle=oracle, monkeypatch=monkeypatch)  # no preemption
    assert [o.outputs[0].token_ids for o in outs] == refs
    st = llm.engine.stats()
    # the drafts were really used: with a large budget most tokens came from accepted drafts; with a
    # small one drafts only get what the prefills leave over
    assert st["spec_draft_tokens"] > st["spec_accepted_tokens"] > (len(prompts) * MAX_TOKENS // 4 if chunk >= 32 else 0)
    if k == 5 and chunk == 512:
        assert llm.engine.num_steps < MAX_TOKENS  # fewer passes than tokens


def test_drafts_with_preemption_and_a_tight_cache(tiny_llama, monkeypatch):
    prompts = make_prompts(384)
    refs = hf_reference(tiny_llama, prompts, max_tokens=MAX_TOKENS)
    oracle = OracleDrafts(prompts, refs, p_wrong=0.2, seed=3)
    llm, outs = run(tiny_llama, prompts, k=4, chunk=64, block_size=4, num_kv_blocks=60, oracle=oracle,
                    monkeypatch=monkeypatch)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert llm.engine.stats()["num_preemptions"] > 0
    assert llm.engine.stats()["spec_accepted_tokens"] > 0


def test_only_verified_tokens_enter_the_prefix_cache(tiny_llama, monkeypatch):
    """Every cached block holds tokens of a request's real sequence (never a rejected draft), and
    a later request that reuses those blocks gets transformers' output."""
    prompts = make_prompts(384)[:6]
    refs = hf_reference(tiny_llama, prompts, max_tokens=MAX_TOKENS)
    oracle = OracleDrafts(prompts, refs, p_wrong=0.5, seed=7)
    # all six admitted in the first step (no admission cap): prompt 1, a prefix of prompt 0, with it
    llm, outs = run(tiny_llama, prompts, k=6, block_size=2, oracle=oracle, monkeypatch=monkeypatch,
                    max_admitted_prefill_tokens=None)
    assert [o.outputs[0].token_ids for o in outs] == refs
    seqs = [tuple(p + r) for p, r in zip(prompts, refs)]
    stack = [((), llm.engine.scheduler.kv.radix.root)]
    n_paths = 0
    while stack:
        path, node = stack.pop()
        path = path + tuple(node.tokens)
        assert any(s[:len(path)] == path for s in seqs), "a cached block holds tokens of no real sequence"
        n_paths += 1
        stack.extend((path, c) for c in node.children.values())
    assert n_paths > len(prompts)
    # continue from cached prompt + output: the reused KV (written while verifying drafts) is right
    longer = [p + r[:11] for p, r in zip(prompts, refs)]
    monkeypatch.undo()
    again = llm.generate(longer, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in again] == [r[11:16] for r in refs]
    # the prefix cache serves exactly what it serves after plain decoding (prompts of odd length
    # end mid-block; prompt 1, a prefix of prompt 0 computed in the same step, keeps a duplicate
    # block and its later blocks stay out of the tree, drafts or not)
    plain = LLM(model=str(tiny_llama), dtype="float64", block_size=2, num_kv_blocks=512,
                max_admitted_prefill_tokens=None)
    plain.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    plain_again = plain.generate(longer, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert [o.num_cached_tokens for o in again] == [o.num_cached_tokens for o in plain_again]
    assert [o.num_cached_tokens - len(p) for o, p in zip(again, prompts)] == [10, 0, 9, 10, 9, 9]


def test_stops_inside_an_accepted_draft(tiny_llama, monkeypatch):
    """A stop token or a stop string met in the middle of an accepted draft ends the output exactly
    where plain decoding ends it (the tokens after it are dropped); max_tokens clips the draft."""
    prompts = make_prompts(384)[:8]
    refs = hf_reference(tiny_llama, prompts, max_tokens=MAX_TOKENS)
    plain = LLM(model=str(tiny_llama), dtype="float64")
    stop_string = plain.tokenizer.decode(refs[2][6:8])
    cases = [
        (SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stop_token_ids=[refs[0][5]]),
         0, "stop", refs[0][5]),
        (SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True), 1, "length", None),
        (SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stop=[stop_string]),
         2, "stop", stop_string),
    ]
    for params, row, reason, stop_reason in cases:
        want = plain.generate(prompts, params)
        assert (want[row].outputs[0].finish_reason, want[row].outputs[0].stop_reason) == (reason, stop_reason)
        oracle = OracleDrafts(prompts, refs, p_wrong=0.0)  # every draft fully accepted
        llm, got = run(tiny_llama, prompts, k=6, params=params, oracle=oracle, monkeypatch=monkeypatch)
        for w, g in zip(want, got):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            assert g.outputs[0].text == w.outputs[0].text
            assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
            assert g.outputs[0].stop_reason == w.outputs[0].stop_reason
        assert llm.engine.stats()["spec_accepted_tokens"] > 0
        # with logprobs: one entry per kept token, none for the dropped ones
        params = replace(params, logprobs=1)
        want = plain.generate(prompts, params)
        oracle = OracleDrafts(prompts, refs, p_wrong=0.0)
        llm, got = run(tiny_llama, prompts, k=6, params=params, oracle=oracle, monkeypatch=monkeypatch)
        for w, g in zip(want, got):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            assert [lp.token_id for lp in g.outputs[0].token_logprobs] == g.outputs[0].token_ids
            for a, b in zip(g.outputs[0].token_logprobs, w.outputs[0].token_logprobs):
                assert a.logprob == pytest.approx(b.logprob, abs=1e-12)
        assert llm.engine.stats()["spec_accepted_tokens"] > 0


def test_streaming_deltas_with_drafts(tiny_llama, monkeypatch):
    prompts = make_prompts(384)[:3]
    refs = hf_reference(tiny_llama, prompts, max_tokens=MAX_TOKENS)
    oracle = OracleDrafts(prompts, refs, p_wrong=0.0)
    monkeypatch.setattr(NgramIndex, "propose", lambda self, t, n: oracle.propose(self, t, n))
    llm = LLM(model=str(tiny_llama), dtype="float64", num_speculative_tokens=3)
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    deltas: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    sizes = []
    while eng.has_unfinished():
        for out in eng.step():
            deltas[out.request_id] += out.outputs[0].delta_token_ids
            sizes.append(len(out.outputs[0].delta_token_ids))
    assert [deltas[f"r{i}"] for i in range(3)] == refs
    assert max(sizes) == 4  # a step delivers the 3 accepted draft tokens and the bonus token


def test_who_speculates(tiny_llama, monkeypatch):
    """Sampled, penalties and n > 1 never draft; in a batch with drafting greedy requests their
    outputs are what they are without drafts. Greedy with logprobs drafts: its kept tokens'
    logprobs come from the verified rows (float64 here: equal to decoding's within rounding;
    bitwise in batch-invariant mode, tests/test_batch_invariance.py)."""
    monkeypatch.setattr(NgramIndex, "propose", lambda self, tokens, k: [7] * k)  # always a (wrong) draft
    prompt = [5, 6, 7, 8] * 12
    cases = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.7, n=2, seed=4, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, min_tokens=5),  # drafts once 5 tokens are out
    ]
    base = LLM(model=str(tiny_llama), dtype="float64")
    spec = LLM(model=str(tiny_llama), dtype="float64", num_speculative_tokens=4)
    spec.engine.check_integrity_each_step = True
    want = base.generate([prompt] * len(cases), cases)
    got = spec.generate([prompt] * len(cases), cases)
    for w, g in zip(want, got):
        assert [o.token_ids for o in g.outputs] == [o.token_ids for o in w.outputs]
        for go, wo in zip(g.outputs, w.outputs):
            assert (go.token_logprobs is None) == (wo.token_logprobs is None)
            if wo.token_logprobs is not None:
                assert len(go.token_logprobs) == len(wo.token_logprobs) == len(wo.token_ids)
                for a, b in zip(go.token_logprobs, wo.token_logprobs):
                    assert a.logprob == pytest.approx(b.logprob, abs=1e-12)
                    assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
    for p in (cases[1], cases[3], cases[4]):
        solo = LLM(model=str(tiny_llama), dtype="float64", num_speculative_tokens=4)
        solo.generate([prompt], p)
        assert solo.engine.stats()["spec_draft_tokens"] == 0, p
    for p in (cases[0], cases[2]):
        solo = LLM(model=str(tiny_llama), dtype="float64", num_speculative_tokens=4)
        solo.generate([prompt], p)
        assert solo.engine.stats()["spec_draft_tokens"] > 0, p


def test_disable_by_batch_size(tiny_llama, monkeypatch):
    monkeypatch.setattr(NgramIndex, "propose", lambda self, tokens, k: [7] * k)
    prompt = [5, 6, 7, 8] * 12
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    drafts = {}
    for limit in (3, 4):
        llm = LLM(model=str(tiny_llama), dtype="float64", num_speculative_tokens=4,
                  speculative_disable_by_batch_size=limit)
        outs = llm.generate([prompt, prompt + [9], prompt + [10]], params)
        drafts[limit] = llm.engine.stats()["spec_draft_tokens"]
        assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert drafts[3] == 0 and drafts[4] > 0


@pytest.mark.parametrize("kw,field", [
    (dict(num_speculative_tokens=-1), "num_speculative_tokens"),
    (dict(num_speculative_tokens=2.5), "num_speculative_tokens"),
    (dict(num_speculative_tokens=2, prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_min"),
    (dict(num_speculative_tokens=2, prompt_lookup_min=0), "prompt_lookup_min"),
    (dict(num_speculative_tokens=2, speculative_disable_by_batch_size=0), "speculative_disable_by_batch_size"),
])
def test_bad_speculative_config(tiny_llama, kw, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        LLM(model=str(tiny_llama), dtype="float64", **kw)


def test_cli_flags_reach_the_scheduler():
    import argparse

    from prefixkv.cli import add_engine_args, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_config_from_args(p.parse_args(
        ["--num-speculative-tokens", "3", "--prompt-lookup-max", "4", "--speculative-disable-by-batch-size", "8"]))
    s = cfg.scheduler
    assert (s.num_speculative_tokens, s.prompt_lookup_min, s.prompt_lookup_max,
            s.speculative_disable_by_batch_size) == (3, 1, 4, 8)


def test_server_with_drafts(tiny_llama, monkeypatch):
    """``prefixkv serve --num-speculative-tokens``: streamed and non-streamed chat answers equal plain
    decoding's, several tokens arrive per step, and /metrics counts drafts and accepted tokens."""
    import urllib.request

    import openai

    from prefixkv.async_engine import AsyncEngine
    from prefixkv.config import EngineConfig, SchedulerConfig
    from prefixkv.engine import LLMEngine
    from prefixkv.server.app import BackgroundServer, ServerConfig

    plain = LLM(model=str(tiny_llama), dtype="float64")
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "count to ten"}]
    want = plain.chat(messages, greedy)[0].outputs[0].text

    def oracle(self, tokens, k):  # plain greedy's next k tokens, the last one made wrong
        nxt = plain.generate([list(tokens)], SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True))
        toks = list(nxt[0].outputs[0].token_ids)
        return toks[:-1] + [(toks[-1] + 1) % 384] if len(toks) > 1 else toks

    monkeypatch.setattr(NgramIndex, "propose", oracle)
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), dtype="float64",
                                    scheduler=SchedulerConfig(num_speculative_tokens=4)))
    with BackgroundServer(AsyncEngine(engine), ServerConfig("tiny")) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        kw = dict(model="tiny", messages=messages, max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True})
        r = client.chat.completions.create(**kw)
        assert r.choices[0].message.content == want and r.usage.completion_tokens == 12
        chunks = [c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                  if c.choices]
        assert "".join(chunks) == want
        assert len([c for c in chunks if c]) < 12  # several tokens per chunk: drafts were accepted
        text = urllib.request.urlopen(srv.url + "/metrics", timeout=10).read().decode()
    m = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(m["prefixkv_spec_draft_tokens_total"]) > float(m["prefixkv_spec_accepted_tokens_total"]) > 0


# ---------------------------------------------------------------------------------------- scheduler
def _sched_with_drafts(monkeypatch, num_blocks, block_size, budget, k, max_seqs=64, draft_token=7):
    from prefixkv.config import CacheConfig, SchedulerConfig
    from prefixkv.scheduler import Scheduler

    monkeypatch.setattr(NgramIndex, "propose", lambda self, tokens, n: [draft_token] * n)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, num_speculative_tokens=k,
                                     watermark=0.0), CacheConfig(block_size=block_size), num_blocks)


def _req(i, tokens, max_tokens=100):
    from prefixkv.request import Request

    return Request(f"r{i}", tokens, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), i, 0)


def test_drafts_only_take_budget_left_after_every_request(monkeypatch):
    """Drafts come last: every running request gets its token, waiting ones are admitted, and only
    then do decodes (oldest first) get drafts from what is left of the budget."""
    s = _sched_with_drafts(monkeypatch, num_blocks=256, block_size=4, budget=20, k=16)
    reqs = [_req(i, [10 + i, 11, 12]) for i in range(8)]
    for r in reqs:
        s.add_request(r)
    out = s.schedule()  # 8 prompts of 3 tokens, budget 20: r0-r5 whole, 2 tokens of r6, r7 waits
    assert [x.num_scheduled_tokens for x in out.scheduled] == [3, 3, 3, 3, 3, 3, 2] and not any(x.draft for x in out.scheduled)
    s.update(out, [[1]] * 6 + [[]])
    out = s.schedule()
    s.add_request(late := _req(8, list(range(30, 36))))  # arrives after this step was scheduled
    assert sorted(x.req.seq_id for x in out.scheduled) == sorted(r.seq_id for r in reqs)
    # 6 decodes + r6's last prompt token + r7's 3 = 10 tokens; the 10 left go to the oldest decode
    drafted = [x for x in out.scheduled if x.draft]
    assert [(x.req.seq_id, len(x.draft)) for x in drafted] == [("r0#0", 10)]
    assert out.num_batched_tokens == 20 and out.num_decodes == 6  # r6's last prompt token is a decode row
    s.update(out, [[7] * 9 if x.draft else [1] * x.num_samples for x in out.scheduled])
    out = s.schedule()  # the late request is admitted before anyone drafts
    assert late.seq_id in {x.req.seq_id for x in out.scheduled}
    assert all(x.num_scheduled_tokens >= 1 for x in out.scheduled) and len(out.scheduled) == 9
    s.check_integrity()


def test_rejected_drafts_give_their_blocks_back_and_preempt_nobody(monkeypatch):
    """An old decode whose drafts are always rejected next to a younger request in a cache of 12
    blocks: the younger one is never preempted, and after each step the decode holds no block
    beyond its known tokens (a rejected draft's blocks go back at once)."""
    s = _sched_with_drafts(monkeypatch, num_blocks=12, block_size=4, budget=32, k=4)
    a, b = _req(0, [5, 6, 7]), _req(1, list(range(40, 60)))  # b: 20 tokens, 5 blocks, then grows
    s.add_request(a)
    s.update(s.schedule(), [[1]])
    s.add_request(b)
    for _ in range(12):
        out = s.schedule()
        sampled = [[9] if x.draft else [1] * x.num_samples for x in out.scheduled]  # 9 != 7: rejected
        for r in s.update(out, sampled):
            if r is b and b.num_output_tokens >= 6:
                s.finish_request(b, RequestStatus.FINISHED_LENGTH)
        assert len(s.kv.block_tables[a.seq_id][0]) <= -(-a.num_tokens // 4)  # no blocks beyond its known tokens
        s.check_integrity()
    assert b.is_finished and b.num_preemptions == 0 and s.num_preemptions == 0
    assert s.num_draft_tokens >= 4 * 6 and s.num_accepted_tokens == 0


def test_real_ngram_drafts_through_the_engine(tiny_llama):
    """No stand-in proposer: prompt lookup on prompts that repeat themselves, outputs equal
    transformers' and the proposer really drafted."""
    base = make_prompts(384, n=6, seed=5)
    prompts = [p[:12] * 4 + p for p in base]  # a repeated 12-token phrase, then the prompt
    refs = hf_reference(tiny_llama, prompts, max_tokens=MAX_TOKENS)
    llm, outs = run(tiny_llama, prompts, k=3)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert llm.engine.stats()["spec_draft_tokens"] > 0
