"""The lossless contract: greedy outputs token-identical to transformers' per-sequence ``generate``
(float64, CPU) across batch sizes, chunk budgets, block sizes, prefix caching and preemption."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from prefixkv import LLM, SamplingParams

MAX_TOKENS = 10
CHUNKS = (7, 32, 512)


def random_prompts(vocab: int, n: int, seed: int, shared_len: int, max_own: int) -> list[list[int]]:
    """n prompts; the even ones start with the same ``shared_len`` tokens, each has 1 .. max_own - 1
    tokens of its own."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(shared_len)]
    prompts = []
    for i in range(n):
        own = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, max_own))]
        prompts.append(shared + own if i % 2 == 0 else own)
    return prompts


def make_prompts(vocab: int, n: int = 17, seed: int = 0) -> list[list[int]]:
    prompts = random_prompts(vocab, n, seed, shared_len=37, max_own=60)  # 37: more than one 16-token block
    prompts[1] = prompts[0][:20]  # a prompt that is a prefix of another
    return prompts


_REF_CACHE: dict = {}


def hf_reference(model_dir, prompts: list[list[int]], max_tokens: int = MAX_TOKENS, stop_on_eos: bool = False):
    from transformers import AutoModelForCausalLM

    key = (str(model_dir), tuple(map(tuple, prompts)), max_tokens, stop_on_eos)
    if key not in _REF_CACHE:
        # MoE models: the eager experts (transformers' grouped_mm refuses float64)
        moe = any(k in json.loads((Path(model_dir) / "config.json").read_text()) for k in ("num_experts", "num_local_experts"))
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float64,
                                                  **({"experts_implementation": "eager"} if moe else {}))
        refs = []
        for p in prompts:
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
                              eos_token_id=2 if stop_on_eos else None)
            refs.append(out[0, len(p):].tolist())
        _REF_CACHE[key] = refs
    return _REF_CACHE[key]


def run_engine(model_dir, prompts, *, chunk=512, block_size=16, prefix=True, num_kv_blocks=512,
               max_tokens=MAX_TOKENS, ignore_eos=True, max_num_seqs=64, cap="auto"):
    llm = LLM(model=str(model_dir), dtype="float64", block_size=block_size, enable_prefix_caching=prefix,
              max_num_batched_tokens=chunk, num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs,
              max_admitted_prefill_tokens=cap)
    llm.engine.check_integrity_each_step = True
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos))
    assert llm.engine.scheduler.kv.num_used_blocks == 0, "blocks leaked after all requests ended"
    return llm, outs


# cap: max_admitted_prefill_tokens; "auto" (the default) spreads the 17 prompts over a few steps,
# None admits them all in the first (a prompt that is a prefix of another shares its blocks there)
@pytest.mark.parametrize("batch,cap", [(1, "auto"), (3, "auto"), (17, "auto"), (17, None)])
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("prefix", [True, False])
def test_llama_matrix(tiny_llama, batch, cap, chunk, block_size, prefix):
    prompts = make_prompts(384)[:batch]
    refs = hf_reference(tiny_llama, make_prompts(384))[:batch]
    _, outs = run_engine(tiny_llama, prompts, chunk=chunk, block_size=block_size, prefix=prefix, cap=cap)
    assert [o.token_ids for o in outs] == refs


FAMILIES = ["tiny_mistral", "tiny_qwen2", "tiny_qwen3", "tiny_mistral_window", "tiny_gemma2", "tiny_gemma3",
            "tiny_phi3", "tiny_phi3_longrope", "tiny_mixtral", "tiny_qwen3_moe"]


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("batch", [1, 17])
@pytest.mark.parametrize("chunk,block_size,prefix,cap", [(7, 1, True, "auto"), (32, 16, False, "auto"),
                                                        (512, 16, True, "auto"), (512, 16, True, None),
                                                        (64, 1, False, "auto")])
def test_other_architectures(request, arch, batch, chunk, block_size, prefix, cap):
    model_dir = request.getfixturevalue(arch)
    prompts = make_prompts(384, seed=1)
    refs = hf_reference(model_dir, prompts)
    _, outs = run_engine(model_dir, prompts[:batch], chunk=chunk, block_size=block_size, prefix=prefix, cap=cap)
    assert [o.token_ids for o in outs] == refs[:batch]


@pytest.mark.parametrize("arch", FAMILIES)
def test_other_architectures_under_preemption(request, arch):
    model_dir = request.getfixturevalue(arch)
    prompts = make_prompts(384, seed=1)
    refs = hf_reference(model_dir, prompts, max_tokens=16)
    # windowed layers hold a few blocks once past their window: a smaller pool for them to preempt
    num_kv_blocks = {"tiny_mistral_window": 16, "tiny_qwen3": 40, "tiny_gemma2": 40, "tiny_gemma3": 40}.get(arch, 80)
    llm, outs = run_engine(model_dir, prompts, chunk=48, block_size=4, num_kv_blocks=num_kv_blocks, max_tokens=16)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == refs


@pytest.mark.parametrize("arch", ["tiny_qwen3", "tiny_mistral_window", "tiny_gemma2", "tiny_gemma3"])
def test_sliding_windows_matter_and_survive_preemption(request, arch, tmp_path):
    """Prompts of 20-100 tokens against windows of 4-8: the same tokens as transformers with forced
    preemption (out-of-window blocks freed: a small pool) and from a warm prefix cache (hits need
    each window's blocks at the hit's end), and different tokens with the window taken away."""
    import json
    import shutil

    model_dir = request.getfixturevalue(arch)
    prompts = make_prompts(384, seed=1)
    refs = hf_reference(model_dir, prompts, max_tokens=16)
    # windowed layers hold a few blocks once past their window: a smaller pool for them to preempt
    num_kv_blocks = {"tiny_mistral_window": 16, "tiny_qwen3": 40, "tiny_gemma2": 40, "tiny_gemma3": 40}[arch]
    llm, outs = run_engine(model_dir, prompts, chunk=48, block_size=4, num_kv_blocks=num_kv_blocks, max_tokens=16)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == refs
    llm, outs = run_engine(model_dir, prompts, chunk=48, block_size=4, max_tokens=16)
    assert [o.token_ids for o in outs] == refs
    again = llm.generate(prompts[:4], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in again] == refs[:4]
    assert [o.num_cached_tokens for o in again] == [len(p) - 1 - (len(p) - 1) % 4 for p in prompts[:4]]
    unwindowed = tmp_path / "no-window"
    shutil.copytree(model_dir, unwindowed)
    cfg = json.loads((unwindowed / "config.json").read_text())
    cfg["sliding_window"] = None
    cfg.pop("layer_types", None)
    (unwindowed / "config.json").write_text(json.dumps(cfg))
    _, plain = run_engine(unwindowed, prompts, max_tokens=16)
    assert any(o.token_ids != r for o, r in zip(plain, refs))  # the window changes the outputs


@pytest.mark.parametrize("block_size", [1, 16])
def test_preemption_is_invisible(tiny_llama, block_size):
    prompts = make_prompts(384)
    refs = hf_reference(tiny_llama, prompts, max_tokens=24)
    # 17 sequences of up to ~120 tokens, but room for only a few at once
    tokens_room = 260
    llm, outs = run_engine(tiny_llama, prompts, chunk=64, block_size=block_size,
                           num_kv_blocks=tokens_room // block_size, max_tokens=24)
    assert llm.engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert [o.token_ids for o in outs] == refs


def test_stops_on_eos_like_transformers(tiny_llama):
    prompts = make_prompts(384, seed=3)
    refs = hf_reference(tiny_llama, prompts, max_tokens=40, stop_on_eos=True)
    assert sum(r[-1] == 2 for r in refs) >= 3, "this seed was chosen so that several prompts end on eos"
    _, outs = run_engine(tiny_llama, prompts, max_tokens=40, ignore_eos=False)
    assert [o.token_ids for o in outs] == refs
    for o, r in zip(outs, refs):
        assert o.finish_reason == ("stop" if r and r[-1] == 2 else "length")


@pytest.mark.parametrize("cap,steps", [(None, 4), (16, 8), ("auto", 6)])
def test_shared_system_prompt_is_computed_once(tiny_llama, cap, steps):
    rng = random.Random(5)
    system = [rng.randrange(3, 384) for _ in range(100)]
    prompts = [system + [rng.randrange(3, 384) for _ in range(5)] for _ in range(8)]
    llm = LLM(model=str(tiny_llama), dtype="float64", block_size=16, num_kv_blocks=256,
              max_admitted_prefill_tokens=cap)
    llm.engine.check_integrity_each_step = True
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    # submitted together: the first computes the 100 shared tokens; the other 7 reuse its 6 full
    # blocks, scheduled in the same step (the blocks are shared as soon as they are scheduled).
    # With max_admitted_prefill_tokens=16: 105 tokens in step 1, then two turns of 9 new tokens a
    # step (9 < 16 admits a second), the last in step 5, its 4th token in step 8. With "auto" (the
    # default): 105 in step 1, four turns in step 2 (the cap 32: 27 < 32 admits a fourth), the last
    # three in step 3 (cap 64), their 4th token in step 6.
    assert [o.num_cached_tokens for o in outs] == [0] + [96] * 7
    assert llm.engine.num_steps == steps
    stats = llm.engine.stats()
    assert stats["prefix_hit_tokens"] == 96 * 7
    refs = hf_reference(tiny_llama, prompts, max_tokens=4)
    assert [o.token_ids for o in outs] == refs


def test_second_chat_turn_computes_only_new_tokens(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float64", block_size=4, num_kv_blocks=256)
    conv = [{"role": "system", "content": "You are a helpful assistant that answers with care."},
            {"role": "user", "content": "Tell me about the quick brown fox."}]
    turn1 = llm.chat(conv, SamplingParams(max_tokens=12, temperature=0.0))[0]
    conv2 = conv + [{"role": "assistant", "content": turn1.text}, {"role": "user", "content": "And the dog?"}]
    prompt2 = llm.tokenizer.apply_chat_template(conv2)
    turn2 = llm.chat(conv2, SamplingParams(max_tokens=4, temperature=0.0))[0]
    # everything up to the end of the first turn's computed tokens is reused, in whole blocks
    common = 0
    history = turn1.prompt_token_ids + turn1.token_ids
    while common < min(len(history), len(prompt2)) and history[common] == prompt2[common]:
        common += 1
    computed_turn1 = len(turn1.prompt_token_ids) + len(turn1.token_ids) - 1
    expected = min(common, computed_turn1, len(prompt2) - 1) // 4 * 4
    assert turn2.num_cached_tokens == expected
    assert expected >= len(turn1.prompt_token_ids) // 4 * 4
    assert len(prompt2) - turn2.num_cached_tokens < 4 + (len(prompt2) - common)


def test_a_failed_forward_pass_leaves_no_uncomputed_blocks_in_the_cache(tiny_llama):
    prompt = make_prompts(384)[0]
    refs = hf_reference(tiny_llama, [prompt])
    llm = LLM(model=str(tiny_llama), dtype="float64", block_size=4, num_kv_blocks=128)
    real = llm.engine.runner.execute

    def interrupted(out):  # the step's blocks were scheduled (and cached) but never computed
        raise KeyboardInterrupt

    llm.engine.runner.execute = interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    llm.engine.runner.execute = real
    assert llm.engine.scheduler.kv.num_used_blocks == 0 and llm.engine.scheduler.kv.radix.num_cached_blocks == 0
    out = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))[0]
    assert out.num_cached_tokens == 0 and out.token_ids == refs[0]
