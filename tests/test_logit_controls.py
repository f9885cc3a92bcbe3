"""The request fields that steer sampling without a grammar (issue 18): ``logit_bias``,
``allowed_token_ids``, ``include_stop_str_in_output``, and ``chat_template_kwargs`` for the template.
Greedy rows are checked against transformers' float64 logits with the same bias / mask applied;
rows without them are unchanged by such neighbours; bad values are a ValueError / 400 naming the field."""

from __future__ import annotations

import pytest
import torch

from prefixkv import LLM, SamplingParams

PROMPTS = [[5 + (i * 11 + k) % 300 for i in range(7 + 4 * k)] for k in range(4)]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=str(tiny_llama), dtype="float64", num_kv_blocks=256)


@pytest.fixture(scope="module")
def hf(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float64)


def _reference(hf, prompt: list[int], steps: int, adjust) -> list[int]:
    """Greedy decoding by transformers with ``adjust(logits)`` applied before each argmax."""
    ids = list(prompt)
    for _ in range(steps):
        logits = hf(torch.tensor([ids])).logits[0, -1].clone()
        ids.append(int(adjust(logits).argmax()))
    return ids[len(prompt):]


def test_logit_bias_greedy_equals_argmax_of_biased_logits(llm, hf):
    plain = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1, temperature=0.0))[0].outputs[0].token_ids[0]
    bias = {plain: -100.0, 17: 3.5, 42: 2.0}  # the unbiased choice pushed away, two others raised

    def adjust(logits):
        for t, b in bias.items():
            logits[t] += b
        return logits

    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias=bias)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, sp)):
        assert out.outputs[0].token_ids == _reference(hf, prompt, 6, adjust)
    forced = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                                      logit_bias={77: 100.0}))[0]
    assert forced.outputs[0].token_ids == [77] * 4


def test_allowed_token_ids_greedy_and_sampled(llm, hf):
    allowed = [9, 23, 101, 250]

    def adjust(logits):
        keep = logits[allowed].clone()
        logits[:] = float("-inf")
        logits[allowed] = keep
        return logits

    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, allowed_token_ids=allowed)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, greedy)):
        assert out.outputs[0].token_ids == _reference(hf, prompt, 5, adjust)
    sampled = SamplingParams(max_tokens=12, temperature=1.5, seed=3, n=3, ignore_eos=True, allowed_token_ids=allowed)
    for out in llm.generate(PROMPTS, sampled):
        assert all(set(c.token_ids) <= set(allowed) for c in out.outputs)


def test_rows_without_them_are_unchanged_by_such_neighbours(llm):
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, plain)]
    steered = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logit_bias={3: 50.0}),
               SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, allowed_token_ids=[4, 5])]
    mixed = llm.generate(PROMPTS, [plain, steered[0], plain, steered[1]])
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == [alone[0], alone[2]]
    assert mixed[1].outputs[0].token_ids == [3] * 8 and set(mixed[3].outputs[0].token_ids) <= {4, 5}


def test_include_stop_str_in_output(llm):
    full = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].outputs[0]
    stop = full.text[3:5]
    assert len(stop) == 2 and stop not in full.text[:4]
    cut = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=stop))[0]
    kept = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=stop,
                                                    include_stop_str_in_output=True))[0]
    i = full.text.index(stop)
    assert cut.outputs[0].text == full.text[:i] and kept.outputs[0].text == full.text[:i + len(stop)]
    assert cut.outputs[0].stop_reason == kept.outputs[0].stop_reason == stop


@pytest.mark.parametrize("kw, field", [(dict(logit_bias={5: 101}), "logit_bias"),
                                       (dict(logit_bias={-1: 1.0}), "logit_bias"),
                                       (dict(logit_bias={10**6: 1.0}), "logit_bias"),
                                       (dict(allowed_token_ids=[]), "allowed_token_ids"),
                                       (dict(allowed_token_ids=[10**6]), "allowed_token_ids"),
                                       (dict(include_stop_str_in_output=1), "include_stop_str_in_output")])
def test_bad_values_name_the_field(llm, kw, field):
    with pytest.raises(ValueError, match=rf"^(prompts\[0\]: )?{field}:"):  # (vocabulary checks: per prompt)
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, **kw))
    assert llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2))[0].outputs[0].token_ids  # still serving


def test_chat_template_kwargs_reach_the_template(tiny_llama):
    from prefixkv.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(str(tiny_llama))
    tok.hf.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                            "{% if shout %} LOUD{% endif %}")
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs, template_kwargs={"shout": True}) == tok.encode("hi LOUD", add_special_tokens=False)
    assert tok.apply_chat_template(msgs) == tok.encode("hi", add_special_tokens=False)
    with pytest.raises(ValueError, match="^chat_template_kwargs: 'tools'"):
        tok.apply_chat_template(msgs, template_kwargs={"tools": []})


# ---------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def client(tiny_llama):
    """A server on its own engine (the offline ``llm`` computes references: one engine must never
    be driven by the server's thread and by ``LLM.generate`` at once)."""
    import openai

    from prefixkv.async_engine import AsyncEngine
    from prefixkv.server.app import BackgroundServer, ServerConfig

    served = LLM(model=str(tiny_llama), dtype="float64", num_kv_blocks=256)
    with BackgroundServer(AsyncEngine(served.engine), ServerConfig("tiny")) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def test_server_honours_them(client, llm):
    prompt = PROMPTS[0]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0,
                                  logit_bias={"77": 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == llm.tokenizer.decode([77] * 3)
    def token_strings(**extra) -> list[str]:
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=1.0, seed=1, logprobs=0,
                                      extra_body={"ignore_eos": True, **extra})
        return r.choices[0].logprobs.tokens

    named = {t: token_strings(logit_bias={str(t): 100})[0] for t in (77, 78)}
    drawn = token_strings(allowed_token_ids=[77, 78])
    assert len(drawn) == 6 and set(drawn) <= set(named.values()) and len(set(named.values())) == 2
    full = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[3:5]
    kept = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stop=stop,
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == full[:full.index(stop) + len(stop)]
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                          extra_body={"chat_template_kwargs": {"anything": 1}})
    assert chat.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("body, param", [({"logit_bias": {"abc": 1}}, "logit_bias"),
                                         ({"logit_bias": {"5": 500}}, "logit_bias"),
                                         ({"allowed_token_ids": [-3]}, "allowed_token_ids"),
                                         ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs")])
def test_server_bad_values_are_400_naming_the_field(client, body, param):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       extra_body=body)
    assert e.value.body["param"] == param and e.value.body["message"].startswith(param + ":"), e.value.body


def test_server_choices_carry_stop_reason(client, llm):
    """vLLM's ``stop_reason``: the stop string or stop token id that ended a choice, null for
    eos and length; in the response and in the stream's final chunk."""
    prompt = PROMPTS[0]
    full = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length" and full.choices[0].model_extra["stop_reason"] is None
    stop = full.choices[0].text[3:5]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stop=stop,
                                  extra_body={"ignore_eos": True})
    assert (r.choices[0].finish_reason, r.choices[0].model_extra["stop_reason"]) == ("stop", stop)
    first = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    tid = first.outputs[0].token_ids[2]
    chat_kw = dict(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=12, temperature=0)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True, "stop_token_ids": [tid]})
    assert (r.choices[0].finish_reason, r.choices[0].model_extra["stop_reason"]) == ("stop", tid)
    last = [c for c in client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                                 stop=stop, stream=True, extra_body={"ignore_eos": True})][-1]
    assert (last.choices[0].finish_reason, last.choices[0].model_extra["stop_reason"]) == ("stop", stop)
    c = client.chat.completions.create(**chat_kw, extra_body={"stop_token_ids": list(range(384))})
    assert c.choices[0].finish_reason == "stop" and isinstance(c.choices[0].model_extra["stop_reason"], int)


# ---------------------------------------------------------------------- generation_config.json defaults
@pytest.fixture(scope="module")
def gen_model(tiny_llama, tmp_path_factory):
    """The tiny model with sampling defaults in its generation_config.json."""
    import json
    import shutil

    d = tmp_path_factory.mktemp("genconf") / "m"
    shutil.copytree(tiny_llama, d)
    cfg = json.loads((d / "generation_config.json").read_text()) if (d / "generation_config.json").exists() else {}
    cfg.update(temperature=0.0, repetition_penalty=1.5, max_new_tokens=7)
    (d / "generation_config.json").write_text(json.dumps(cfg))
    return d


def test_generation_config_defaults_fill_what_a_request_leaves_unset(gen_model):
    import openai

    from prefixkv.async_engine import AsyncEngine
    from prefixkv.server.app import BackgroundServer, ServerConfig

    llm = LLM(model=str(gen_model), dtype="float64", num_kv_blocks=128)
    assert llm.engine.default_sampling == {"temperature": 0.0, "repetition_penalty": 1.5, "max_tokens": 7}
    explicit = SamplingParams(temperature=0.0, repetition_penalty=1.5, max_tokens=7)
    want = llm.generate(PROMPTS[:2], explicit)
    got = llm.generate(PROMPTS[:2])  # no params: the model's defaults (vLLM's get_default_sampling_params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert all(len(o.outputs[0].token_ids) == 7 or o.outputs[0].finish_reason == "stop" for o in got)
    plain = LLM(model=str(gen_model), dtype="float64", num_kv_blocks=128, generation_config="vllm")
    assert plain.engine.default_sampling == {} and plain.get_default_sampling_params().temperature == 1.0
    msgs = [{"role": "user", "content": "hi"}]
    ref = llm.generate([llm.tokenizer.apply_chat_template(msgs)], explicit)[0].outputs[0]
    served = AsyncEngine(llm.engine)  # closed below: then nothing but this test drives the engine
    with BackgroundServer(served, ServerConfig("g")) as srv:  # (no LLM.generate from here)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model="g", messages=msgs)  # nothing set: the defaults
        assert r.choices[0].message.content == ref.text and r.usage.completion_tokens == len(ref.token_ids)
        r = client.chat.completions.create(model="g", messages=msgs, max_tokens=3)  # a request's own value wins
        assert r.usage.completion_tokens == 3 or r.choices[0].finish_reason == "stop"
        assert r.choices[0].message.content == ref.text[:len(r.choices[0].message.content)]
    served.close()


def test_a_bad_generation_config_names_the_file(gen_model, tmp_path):
    import json
    import shutil

    d = tmp_path / "bad"
    shutil.copytree(gen_model, d)
    (d / "generation_config.json").write_text(json.dumps({"top_p": 7}))
    with pytest.raises(ValueError, match=r"^generation_config: .*generation_config\.json: top_p:"):
        LLM(model=str(d), dtype="float64", num_kv_blocks=64)


# ---------------------------------------------------------------------- bad_words
def test_bad_words_are_never_generated(llm, hf):
    """Greedy with bad_words equals transformers' greedy where each bad word's last token is masked
    whenever the output so far ends with the word's other tokens (vLLM's rule)."""
    tok = llm.tokenizer
    free = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    words = [tok.decode(free[0].outputs[0].token_ids[2:3]), tok.decode(free[1].outputs[0].token_ids[4:6])]
    words = [w for w in words if w.strip()]
    assert words
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, bad_words=words)
    outs = llm.generate(PROMPTS, sp)
    sp.tokenize_bad_words(lambda text: tok.encode(text, add_special_tokens=False))  # what the engine did
    seqs = sp.bad_words_token_ids
    assert seqs and all(tok.encode(w.lstrip(), add_special_tokens=False) in seqs for w in words)
    for prompt, out in zip(PROMPTS, outs):
        got = out.outputs[0].token_ids
        ids = list(prompt)
        want = []
        for _ in range(10):
            logits = hf(torch.tensor([ids])).logits[0, -1].clone()
            for w in seqs:
                if len(w) - 1 <= len(want) and want[len(want) - len(w) + 1:] == w[:-1]:
                    logits[w[-1]] = float("-inf")
            t = int(logits.argmax())
            want.append(t)
            ids.append(t)
        assert got == want
        for w in seqs:  # no bad word's tokens appear in a row
            assert not any(got[k:k + len(w)] == w for k in range(len(got)))
    assert [o.outputs[0].token_ids for o in outs] != [o.outputs[0].token_ids for o in free]


def test_bad_words_through_the_server(client, llm):
    free = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    word = llm.tokenizer.decode(llm.generate(PROMPTS[:1], SamplingParams(max_tokens=8, temperature=0.0,
                                                                         ignore_eos=True))[0].outputs[0].token_ids[1:2])
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True, "bad_words": [word]})
    assert r.choices[0].text != free
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=2, extra_body={"bad_words": [""]})
    assert e.value.body["param"] == "bad_words"
