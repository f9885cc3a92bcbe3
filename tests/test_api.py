"""The offline API's contract: inputs, outputs, errors naming the field, and bad input never
corrupting engine state."""

from __future__ import annotations

import subprocess
import sys

import pytest

from prefixkv import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=str(tiny_llama), dtype="float64", block_size=8, num_kv_blocks=64, max_model_len=200)


@pytest.mark.parametrize("kwargs,field", [
    ({"block_size": 0}, "block_size"), ({"dtype": "int8"}, "dtype"), ({"device": "tpu"}, "device"),
    ({"num_kv_blocks": 0}, "num_kv_blocks"), ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_batched_tokens": -1}, "max_num_batched_tokens"), ({"scheduling_policy": "fifo"}, "policy"),
    ({"max_model_len": 0}, "max_model_len"), ({"attention_backend": "triton"}, "attention_backend"),
])
def test_bad_engine_arguments_name_the_field(tiny_llama, kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        LLM(model=str(tiny_llama), **kwargs)


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="^model:"):
        LLM(model=str(tmp_path / "nope"))


@pytest.mark.parametrize("prompt,match", [
    ("", "prompt: must not be empty"), ([], "prompts: must not be empty"),
    ([1, 2, 10**6], r"prompt: token ids must be ints in \[0, "), ([1, -3], "prompt: token ids"),
    (list(range(3, 203)), "prompt: 200 tokens leave no room"),
])
def test_bad_prompts_raise_and_leave_the_engine_clean(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([[5, 6, 7], prompt] if prompt != [] else prompt, SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished() and llm.engine.scheduler.kv.num_used_blocks == 0
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0))
    assert len(out[0].token_ids) == 2


def test_prompt_larger_than_the_kv_cache(tiny_llama):
    small = LLM(model=str(tiny_llama), dtype="float64", block_size=8, num_kv_blocks=4)
    with pytest.raises(ValueError, match="prompt: 40 tokens need 6 KV blocks but the cache has only 4"):
        small.generate([list(range(3, 43))])


def test_outputs_in_order_with_mixed_prompt_types(llm):
    outs = llm.generate(["hello world", [5, 6, 7, 8], "你好"], SamplingParams(max_tokens=3, temperature=0.0,
                                                                             ignore_eos=True))
    assert [o.prompt for o in outs] == ["hello world", None, "你好"]
    assert outs[1].prompt_token_ids == [5, 6, 7, 8]
    assert all(o.finish_reason == "length" and len(o.token_ids) == 3 and o.outputs[0].index == 0 for o in outs)
    assert outs[0].prompt_token_ids == llm.tokenizer.encode("hello world")
    params = [SamplingParams(max_tokens=1, temperature=0.0), SamplingParams(max_tokens=4, temperature=0.0)]
    assert [len(o.token_ids) for o in llm.generate([[5, 6], [7, 8]], params)] == [1, 4]
    with pytest.raises(ValueError, match="sampling_params: got 1 for 2 prompts"):
        llm.generate([[5, 6], [7, 8]], params[:1])


def test_max_model_len_stops_with_length(llm):
    out = llm.generate([list(range(3, 195))], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.prompt_token_ids) + len(out.token_ids) == 200


def test_chat_validates_messages(llm):
    with pytest.raises(ValueError, match="messages"):
        llm.chat([])
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        llm.chat([[{"role": "wizard", "content": "hi"}]])
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2, temperature=0.0))
    assert len(out) == 1 and out[0].prompt_token_ids[:1] == llm.tokenizer.encode("<|im_start|>")


def test_cli_generate_prints_the_completion(tiny_llama):
    res = subprocess.run([sys.executable, "-m", "prefixkv.cli", "generate", "hello", "--model", str(tiny_llama),
                          "--max-tokens", "5", "--dtype", "float64"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    llm = LLM(model=str(tiny_llama), dtype="float64")
    expected = llm.generate(["hello"], SamplingParams(max_tokens=5, temperature=0.0))[0].text
    assert res.stdout == expected + "\n"
    bad = subprocess.run([sys.executable, "-m", "prefixkv.cli", "generate", "hello", "--model", str(tiny_llama),
                          "--block-size", "0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "block_size:" in bad.stderr
