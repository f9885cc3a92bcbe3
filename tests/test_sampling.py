"""Sampling: masks, penalties, seeds, n > 1 with copy-on-write, logprobs, stop strings."""

from __future__ import annotations

import random

import pytest
import torch

from prefixkv import LLM, SamplingParams
from prefixkv.runner.sampler import SamplingBatch, apply_penalties, sample, top_k_top_p_min_p_mask


def _batch(rows: int, v: int, **kw) -> SamplingBatch:
    base = dict(
        temperature=torch.ones(rows, dtype=torch.float64), top_k=torch.full((rows,), v),
        top_p=torch.ones(rows, dtype=torch.float64), min_p=torch.zeros(rows, dtype=torch.float64),
        seeds=torch.arange(rows), positions=torch.zeros(rows, dtype=torch.int64), all_greedy=False,
        any_top_k=False, any_top_p=False, any_min_p=False)
    base.update(kw)
    return SamplingBatch(**base)


def test_top_k_top_p_min_p_masks_exact():
    # probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625 (log-space logits)
    logits = torch.tensor([[0.5, 0.25, 0.125, 0.0625, 0.0625]]).log().repeat(3, 1)
    b = _batch(3, 5, top_k=torch.tensor([2, 5, 5]), top_p=torch.tensor([1.0, 0.7, 1.0], dtype=torch.float64),
               min_p=torch.tensor([0.0, 0.0, 0.2], dtype=torch.float64), any_top_k=True, any_top_p=True,
               any_min_p=True)
    mask = top_k_top_p_min_p_mask(logits, b)
    assert mask.tolist() == [
        [False, False, True, True, True],  # top_k = 2
        [False, False, True, True, True],  # top_p = 0.7: 0.5 + 0.25 reaches it
        [False, False, False, True, True],  # min_p = 0.2: keep p >= 0.1
    ]
    # top_p exactly at a boundary keeps the smallest set whose mass reaches it
    b2 = _batch(1, 5, top_p=torch.tensor([0.75], dtype=torch.float64), any_top_p=True)
    assert top_k_top_p_min_p_mask(logits[:1], b2).tolist() == [[False, False, True, True, True]]


def test_repetition_penalty_equals_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    logits = torch.randn(2, 50, dtype=torch.float64)
    seen_ids = torch.tensor([[1, 5, 5, 7], [2, 3, 49, 0]])
    ref = RepetitionPenaltyLogitsProcessor(1.3)(seen_ids, logits.clone())
    seen = torch.zeros(2, 50, dtype=torch.bool)
    seen[torch.arange(2)[:, None], seen_ids] = True
    b = _batch(2, 50, repetition_penalty=torch.tensor([1.3, 1.3], dtype=torch.float64), seen_mask=seen)
    assert torch.equal(apply_penalties(logits, b), ref)


def test_presence_and_frequency_penalties_equal_openai_formula():
    torch.manual_seed(1)
    logits = torch.randn(1, 20, dtype=torch.float64)
    output = [3, 3, 3, 7, 11]
    counts = torch.zeros(1, 20, dtype=torch.int64)
    for t in output:
        counts[0, t] += 1
    b = _batch(1, 20, presence_penalty=torch.tensor([0.5], dtype=torch.float64), frequency_penalty=torch.tensor([0.25], dtype=torch.float64),
               output_counts=counts)
    ref = logits.clone()
    for t in set(output):  # OpenAI: mu[j] -= c[j] * alpha_frequency + (c[j] > 0) * alpha_presence
        ref[0, t] -= output.count(t) * 0.25 + 0.5
    assert torch.allclose(apply_penalties(logits, b), ref, rtol=0, atol=1e-12)


def test_greedy_rows_are_exact_argmax_and_sampling_is_seeded():
    torch.manual_seed(2)
    logits = torch.randn(4, 100, dtype=torch.float64)
    b = _batch(4, 100, temperature=torch.tensor([0.0, 1.0, 1.0, 1.0], dtype=torch.float64),
               seeds=torch.tensor([9, 9, 9, 10]))
    out = sample(logits, b).token_ids
    assert out[0] == int(logits[0].argmax())
    again = sample(logits, b).token_ids
    assert out == again
    # the same seed and position give the same draw in any row of any batch
    solo = sample(logits[1:2], _batch(1, 100, seeds=torch.tensor([9]))).token_ids
    assert solo == [out[1]]
    draws = {sample(logits[:1], _batch(1, 100, seeds=torch.tensor([s]))).token_ids[0] for s in range(40)}
    assert len(draws) > 5


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[0.7, 0.2, 0.1]], dtype=torch.float64).log()
    n = 4000
    toks = sample(logits.repeat(n, 1), _batch(n, 3, seeds=torch.arange(n))).token_ids
    freq = [toks.count(i) / n for i in range(3)]
    assert abs(freq[0] - 0.7) < 0.03 and abs(freq[1] - 0.2) < 0.03 and abs(freq[2] - 0.1) < 0.03


def test_sampling_never_draws_a_token_of_probability_zero():
    """Inverse-CDF sampling over a vocabulary where only a few (scattered, first and last
    included) tokens are possible: every draw is one of them, whatever the uniform."""
    logits = torch.full((1, 50), float("-inf"), dtype=torch.float64)
    allowed = [0, 17, 18, 49]
    logits[0, allowed] = torch.tensor([0.1, -3.0, 2.0, 0.5], dtype=torch.float64)
    n = 2000
    toks = sample(logits.repeat(n, 1), _batch(n, 50, seeds=torch.arange(n))).token_ids
    assert set(toks) == set(allowed)


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("temperature", -1.0), ("top_p", 0.0), ("top_k", -2), ("min_p", 1.5), ("seed", "x"),
    ("presence_penalty", 3.0), ("frequency_penalty", -2.5), ("repetition_penalty", 0.0), ("stop", [""]),
    ("stop_token_ids", [-1]), ("max_tokens", 0), ("min_tokens", -1), ("logprobs", 21), ("ignore_eos", "yes"),
    ("skip_special_tokens", None),
])
def test_sampling_params_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**{field: value})


@pytest.fixture(scope="module")
def llm(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float64", block_size=16, num_kv_blocks=256, max_num_batched_tokens=64)
    llm.engine.check_integrity_each_step = True
    return llm


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 384) for _ in range(rng.randrange(5, 50))] for _ in range(n)]


def test_seeded_output_independent_of_batch_and_cache(llm):
    target = _prompts(1, seed=42)[0]
    sp = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate([target], sp)[0].token_ids  # now also cached
    others = _prompts(6, seed=7)
    batch = llm.generate(others[:3] + [target] + others[3:],
                         [SamplingParams(max_tokens=9, temperature=0.8, seed=i) for i in range(3)] + [sp]
                         + [SamplingParams(max_tokens=5, temperature=0.0) for _ in range(3)])[3].token_ids
    assert batch == alone
    other_seed = llm.generate([target], SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=99,
                                                        ignore_eos=True))[0].token_ids
    assert other_seed != alone


def test_n4_greedy_identical_and_prompt_blocks_held_once(llm):
    prompt = _prompts(1, seed=3)[0][:30]  # 30 tokens: one full block + a partial one (block_size 16)
    engine = llm.engine
    engine.add_request("n4", prompt, SamplingParams(n=4, max_tokens=6, temperature=0.0, ignore_eos=True))
    engine.step()  # prefill + 4 samples: the fork
    tables = {k: v for k, (v,) in engine.scheduler.kv.block_tables.items() if k.startswith("n4#")}
    assert len(tables) == 4 and len({tuple(t) for t in tables.values()}) == 1
    assert engine.scheduler.kv.num_used_blocks == 2  # the prompt's 2 blocks, held once for all 4
    shared_full, shared_partial = next(iter(tables.values()))
    assert engine.scheduler.kv.pool.ref_cnt[shared_partial] == 4
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
    res = outs[0]
    assert [o.index for o in res.outputs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in res.outputs}) == 1
    assert res.token_ids == res.outputs[0].token_ids
    assert engine.scheduler.kv.num_used_blocks == 0


def test_n4_seeded_sampling_reproducible_and_diverse(llm):
    prompt = _prompts(1, seed=4)[0]
    sp = SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    a = llm.generate([prompt], sp)[0]
    b = llm.generate([prompt], sp)[0]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1


def test_logprobs_equal_transformers_log_softmax(llm, tiny_llama):
    from transformers import AutoModelForCausalLM

    prompt = _prompts(1, seed=5)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5))[0]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float64)
    gen = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out.token_ids == gen[0, len(prompt):].tolist()
    for i, (lp, tok) in enumerate(zip(out.outputs[0].token_logprobs, out.token_ids)):
        with torch.no_grad():  # float64 logits of transformers' own forward at this step
            logits = hf(torch.tensor([prompt + out.token_ids[:i]])).logits[0, -1]
        ref = torch.log_softmax(logits, -1)
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(ref[tok].item(), abs=1e-9)
        top = torch.topk(ref, 5)
        assert [t for t, _ in lp.top_logprobs] == top.indices.tolist()
        assert [v for _, v in lp.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-9)
        assert lp.rank == 1  # greedy


def test_vllm_shaped_logprobs_ranks_and_cumulative(llm, tiny_llama):
    """``CompletionOutput.logprobs`` in vLLM's shape: per token a dict over the sampled token and
    the top-k, each with logprob, rank (1 + the tokens more likely, against transformers' float64
    distribution) and decoded text; ``cumulative_logprob`` their sum."""
    from transformers import AutoModelForCausalLM

    from prefixkv import Logprob

    prompt = _prompts(1, seed=7)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=2.0, seed=4, ignore_eos=True,
                                                logprobs=3))[0].outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float64)
    ranks = []
    for i, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt + out.token_ids[:i]])).logits[0, -1], -1)
        top = torch.topk(ref, 3).indices.tolist()
        assert set(entry) == set(top) | {tok}
        rank = int((ref > ref[tok]).sum()) + 1
        assert entry[tok] == Logprob(pytest.approx(ref[tok].item(), abs=1e-9), rank, llm.tokenizer.decode([tok]))
        assert [entry[t].rank for t in top] == [1, 2, 3]
        ranks.append(rank)
    assert max(ranks) > 1  # (sampled at temperature 2: some tokens were not the most likely)
    assert out.cumulative_logprob == pytest.approx(sum(out.logprobs[i][t].logprob
                                                       for i, t in enumerate(out.token_ids)), abs=1e-9)
    plain = llm.generate([prompt], SamplingParams(max_tokens=2))[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None


def _printable_pieces(llm, ids):
    tok = llm.tokenizer
    return [tok.decode([t]) for t in ids]


def test_stop_string_spanning_two_tokens(llm):
    prompt = _prompts(1, seed=6)[0]
    full = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    pieces = _printable_pieces(llm, full.token_ids)
    # a stop string made of the end of one token's text and the start of the next one's
    i = next(i for i in range(3, len(pieces) - 1)
             if pieces[i].isprintable() and pieces[i + 1].isprintable() and pieces[i] and pieces[i + 1]
             and "\ufffd" not in pieces[i] + pieces[i + 1])
    stop = pieces[i][-1] + pieces[i + 1][0]
    expected_end = full.text.find(stop)
    out = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.text == full.text[:expected_end]
    never = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                  stop=["\u2603never\u2603"]))[0]
    assert never.finish_reason == "length" and never.text == full.text


def test_holdback_lengths():
    from prefixkv.output_processor import holdback as _holdback

    assert _holdback("hello wor", ["world"]) == 3
    assert _holdback("hello", ["xyz", "lo!"]) == 2
    assert _holdback("hello", ["abc"]) == 0
    assert _holdback("", ["abc"]) == 0


def test_streaming_holds_back_a_possible_stop_string(llm):
    prompt = _prompts(1, seed=6)[0]
    full = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0].text
    k = len(full) // 2
    stop = full[k:k + 3] + "\u2603"  # its first characters appear in the text, but it never completes
    engine = llm.engine
    engine.add_request("hold", prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop]))
    streamed, held = "", 0
    while engine.has_unfinished():
        for o in engine.step():
            streamed += o.outputs[0].delta_text
            assert full.startswith(streamed)  # nothing sent is ever taken back
            if not o.finished:
                assert not any(streamed.endswith(stop[:j]) for j in range(1, len(stop)))
                held = max(held, len(llm.tokenizer.decode(o.outputs[0].token_ids)) - len(streamed))
    assert streamed == full
    assert held > 0  # something was held back at some step, then released


def test_detokenize_false_returns_ids_only(llm):
    prompt = _prompts(1, seed=8)[0]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with_text = llm.generate([prompt], sp)[0]
    ids_only = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                     detokenize=False))[0]
    assert ids_only.token_ids == with_text.token_ids and ids_only.text == ""
    with pytest.raises(ValueError, match="^stop:"):
        SamplingParams(stop=["x"], detokenize=False)


def test_stop_strings_wait_for_min_tokens(llm):
    prompt = _prompts(1, seed=6)[0]
    full = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    first_piece = llm.tokenizer.decode(full.token_ids[:1])
    stop = first_piece[-1]  # completes with the very first token
    early = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert early.finish_reason == "stop" and len(early.token_ids) == 1
    late = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop],
                                                 min_tokens=6))[0]
    k = len(late.token_ids)
    assert k >= 6 and late.token_ids == full.token_ids[:k]
    if late.finish_reason == "stop":  # the first occurrence completed by token 6 or later
        before = llm.tokenizer.decode(full.token_ids[:k - 1])
        assert stop not in llm.tokenizer.decode(full.token_ids[k - 1:k]) or k >= 6
        assert late.text == full.text[:full.text.index(stop, len(before))]
    else:
        assert late.text == full.text
