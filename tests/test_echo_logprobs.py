"""Completions ``echo`` with ``logprobs`` (issue 41): the prompt's tokens with their logprobs (the first
null), also with ``max_tokens: 0``, streamed or not, equal to transformers' log-softmax over the prompt
on the same weights (float64: 1e-9), whether or not the prompt's prefix was in the prefix cache."""

from __future__ import annotations

import openai
import pytest
import torch

from prefixkv import LLM
from prefixkv.async_engine import AsyncEngine
from prefixkv.server.app import BackgroundServer, ServerConfig

PROMPTS = [[3 + (i * 11 + k * 7) % 300 for i in range(18 + 5 * k)] for k in range(2)]


@pytest.fixture(scope="module")
def served(tiny_llama):
    from transformers import AutoModelForCausalLM

    llm = LLM(model=str(tiny_llama), dtype="float64", num_kv_blocks=128, block_size=4)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float64)
    engine = AsyncEngine(llm.engine)
    with BackgroundServer(engine, ServerConfig("t")) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0), llm, hf
    engine.close()


def _reference(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0], -1)  # row j predicts token j + 1


def _check_prompt(lp, ids: list[int], ref: torch.Tensor, k: int, token_text) -> None:
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[:len(ids)] == [token_text(t) for t in ids]
    for j in range(1, len(ids)):
        row = ref[j - 1]
        assert lp.token_logprobs[j] == pytest.approx(row[ids[j]].item(), abs=1e-9, rel=0)
        top = torch.topk(row, k).indices.tolist()
        # tokens whose texts collide keep the more likely one
        want = {}
        for t in top:
            want.setdefault(token_text(t), row[t].item())
        assert lp.top_logprobs[j] == pytest.approx(want, abs=1e-9, rel=0)
    offsets = [0]
    for t in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp.text_offset == offsets


def test_echo_logprobs_equal_transformers_cached_or_not(served):
    client, llm, hf = served
    text = lambda t: llm.tokenizer.convert_ids_to_tokens([t]) and client_token_text(llm, t)  # noqa: E731
    for cached in (False, True):
        if cached:  # the prompts' blocks are now in the prefix cache: a plain request reads them
            warm = client.completions.create(model="t", prompt=PROMPTS[0], max_tokens=1)
            assert warm.usage.prompt_tokens_details.cached_tokens >= 16
        r = client.completions.create(model="t", prompt=PROMPTS, echo=True, logprobs=3, max_tokens=0)
        assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == sum(map(len, PROMPTS))
        for ids, choice in zip(PROMPTS, r.choices):
            assert choice.finish_reason == "length"
            assert choice.text == llm.tokenizer.decode(ids)
            assert len(choice.logprobs.tokens) == len(ids)
            _check_prompt(choice.logprobs, ids, _reference(hf, ids), 3, text)


def client_token_text(llm, token_id: int) -> str:
    from prefixkv.server.serving import TokenTexts

    return TokenTexts(llm.tokenizer)(token_id)[0]


def test_echo_with_generated_tokens_streamed_equals_whole(served):
    client, llm, hf = served
    prompt = "The quick brown fox"
    ids = llm.tokenizer.encode(prompt)
    kw = dict(model="t", prompt=prompt, echo=True, logprobs=2, max_tokens=4, temperature=0)
    whole = client.completions.create(**kw).choices[0]
    gen = whole.text[len(prompt):]
    assert whole.text.startswith(prompt) and len(whole.logprobs.tokens) == len(ids) + 4
    ref = _reference(hf, ids)
    _check_prompt(whole.logprobs, ids, ref, 2, lambda t: client_token_text(llm, t))
    assert whole.logprobs.token_logprobs[len(ids)] == pytest.approx(ref[-1].max().item(), abs=1e-9)  # greedy
    assert whole.logprobs.text_offset[len(ids)] == len(prompt)
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    assert chunks[0].text.startswith(prompt)
    assert "".join(c.text for c in chunks) == prompt + gen
    assert sum((c.logprobs.token_logprobs for c in chunks), []) == whole.logprobs.token_logprobs
    offsets = sum((c.logprobs.text_offset for c in chunks), [])  # (the generated tokens': from the text sent)
    assert offsets[:len(ids) + 1] == whole.logprobs.text_offset[:len(ids) + 1]
    plain = client.completions.create(model="t", prompt=prompt, echo=True, max_tokens=4, temperature=0).choices[0]
    assert plain.text == whole.text and plain.logprobs is None


def test_prompt_only_needs_echo(served):
    client, _, _ = served
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="t", prompt="hi", max_tokens=0)
    assert e.value.body["param"] == "max_tokens" and e.value.body["message"].startswith("max_tokens:")
