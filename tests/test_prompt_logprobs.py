"""``prompt_logprobs`` (issue 18): each prompt token's logprob given the tokens before it, its rank
and the top-k, against transformers' float64 forward over the prompt (teacher forcing); across
chunked prefill, n > 1, forced preemption (no duplicate), a prefix other requests cached (still
computed: such a request takes no cache hit), and through the server."""

from __future__ import annotations

import pytest
import torch

from prefixkv import LLM, Logprob, SamplingParams

PROMPTS = [[3 + (i * 13 + k * 5) % 300 for i in range(20 + 9 * k)] for k in range(3)]


@pytest.fixture(scope="module")
def hf(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float64)


def _check(out, prompt, hf, k: int, decode) -> None:
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], -1)  # row j predicts token j + 1
    plps = out.prompt_logprobs
    assert plps is not None and len(plps) == len(prompt) and plps[0] is None
    for j, entry in enumerate(plps[1:]):
        row, tok = ref[j], prompt[j + 1]
        top = torch.topk(row, k).indices.tolist() if k else []
        assert set(entry) == set(top) | {tok}
        assert entry[tok] == Logprob(pytest.approx(row[tok].item(), abs=1e-9), int((row > row[tok]).sum()) + 1,
                                     decode(tok))
        assert [entry[t].rank for t in top] == list(range(1, k + 1))
        assert [entry[t].logprob for t in top] == pytest.approx(row[top].tolist(), abs=1e-9)


@pytest.mark.parametrize("chunk", [512, 7])
def test_prompt_logprobs_equal_transformers(tiny_llama, hf, chunk):
    llm = LLM(model=str(tiny_llama), dtype="float64", num_kv_blocks=128, max_num_batched_tokens=chunk)
    sp = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2)
    outs = llm.generate(PROMPTS, sp)
    for prompt, out in zip(PROMPTS, outs):
        _check(out, prompt, hf, 2, lambda t: llm.tokenizer.decode([t], skip_special_tokens=False))
    assert llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2))[0].prompt_logprobs is None


def test_no_cache_hit_n_gt_1_and_preemption(tiny_llama, hf):
    llm = LLM(model=str(tiny_llama), dtype="float64", block_size=4, num_kv_blocks=24, max_num_batched_tokens=64)
    llm.generate(PROMPTS[1:2], SamplingParams(max_tokens=2))  # its blocks are now cached
    out = llm.generate(PROMPTS[1:2], SamplingParams(max_tokens=2, prompt_logprobs=0))[0]
    assert out.num_cached_tokens == 0  # computed whole, for its logprobs
    _check(out, PROMPTS[1], hf, 0, lambda t: llm.tokenizer.decode([t], skip_special_tokens=False))
    # a KV budget that preempts: each prompt's logprobs once, equal to the reference
    sp = SamplingParams(max_tokens=30, temperature=1.0, seed=3, n=2, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate(PROMPTS, sp)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(PROMPTS, outs):
        assert len(out.outputs) == 2
        _check(out, prompt, hf, 1, lambda t: llm.tokenizer.decode([t], skip_special_tokens=False))
    llm.engine.check_integrity()


def test_bad_value_names_the_field(tiny_llama):
    with pytest.raises(ValueError, match="^prompt_logprobs:"):
        SamplingParams(prompt_logprobs=21)


def test_server_prompt_logprobs(tiny_llama):
    import openai

    from prefixkv.async_engine import AsyncEngine
    from prefixkv.server.app import BackgroundServer, ServerConfig

    llm = LLM(model=str(tiny_llama), dtype="float64", num_kv_blocks=128)
    want = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1))
    wire = [[None] + [{str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                       for t, lp in e.items()} for e in w.prompt_logprobs[1:]] for w in want]
    served = AsyncEngine(llm.engine)  # closed below: then nothing but this test drives the engine
    with BackgroundServer(served, ServerConfig("t")) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        r = client.completions.create(model="t", prompt=PROMPTS[:2], max_tokens=2, temperature=0, n=2,
                                      extra_body={"prompt_logprobs": 1})
        # the same entries (token ids, ranks, texts) and the same values up to float64 rounding: the
        # server batches its four sequences otherwise than generate() batched two, and float64 GEMMs are
        # not batch-invariant (1 ulp-scale differences seen); each side is checked against transformers above
        got = [c.model_extra["prompt_logprobs"] for c in r.choices]
        for g, w in zip(got, [wire[0], wire[0], wire[1], wire[1]], strict=True):
            assert g[0] is None and len(g) == len(w)
            for ge, we in zip(g[1:], w[1:]):
                assert {t: (e["rank"], e["decoded_token"]) for t, e in ge.items()} == \
                    {t: (e["rank"], e["decoded_token"]) for t, e in we.items()}
                assert all(ge[t]["logprob"] == pytest.approx(we[t]["logprob"], rel=1e-12, abs=1e-12) for t in we)
        msgs = [{"role": "user", "content": "hello"}]
        c = client.chat.completions.create(model="t", messages=msgs, max_tokens=2, extra_body={"prompt_logprobs": 0})
        plps = c.model_extra["prompt_logprobs"]
        assert plps[0] is None and len(plps) == c.usage.prompt_tokens
        assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in plps[1:])
        plain = client.chat.completions.create(model="t", messages=msgs, max_tokens=2)
        assert plain.model_extra.get("prompt_logprobs") is None
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="t", prompt="x", max_tokens=2, stream=True,
                                      extra_body={"prompt_logprobs": 1})
        assert e.value.body["param"] == "prompt_logprobs"
    served.close()
