"""Batch invariance (issue 14): with ``batch_invariant=True`` (CPU, float32) a request's token ids
and logprobs are bitwise equal (``==`` on the floats) to the same prompt run alone on a cold
engine, whatever else is batched with it, how its prompt is chunked, whether its prefix came from
the cache, whether it was preempted and recomputed, and whether speculative drafts were verified
for it. Tiny random float32 models of each architecture at block sizes 1 and 16; the real SmolLM2
in tests/test_smollm2.py."""

from __future__ import annotations

import pytest

from prefixkv import LLM, SamplingParams
from prefixkv.cpu_ops import gemm_available
from test_lossless import random_prompts

MAX_TOKENS = 12
# the mode needs the C GEMM (an AVX-512 or AVX2 build of the C kernels); elsewhere it is refused (tested below)
needs_the_mode = pytest.mark.skipif(not gemm_available(), reason="C kernels without AVX-512 or AVX2: no batch-invariant mode")


def make_prompts(vocab: int, n: int = 10, seed: int = 0) -> list[list[int]]:
    prompts = random_prompts(vocab, n, seed, shared_len=41, max_own=50)  # 41: more than two 16-token blocks
    prompts[3] = prompts[2][:30]  # a prompt that is a prefix of another
    prompts[5] = prompts[5][:4] * 6  # repetitive: n-gram drafts get proposed and accepted
    return prompts


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)


def _result(out) -> tuple:
    """Token ids, chosen logprobs and top-2 logprobs, as exact floats."""
    c = out.outputs[0]
    return (tuple(c.token_ids), tuple(lp.logprob for lp in c.token_logprobs),
            tuple(tuple(lp.top_logprobs) for lp in c.token_logprobs))


def _llm(model_dir, batch_invariant=True, **kw) -> LLM:
    """model_dir None: the embedded SmolLM2."""
    kw.setdefault("num_kv_blocks", 512)
    llm = LLM(model=None if model_dir is None else str(model_dir), dtype="float32", batch_invariant=batch_invariant,
              **kw)
    llm.engine.check_integrity_each_step = True
    return llm


def alone(model_dir, prompts, block_size: int, batch_invariant: bool = True) -> list[tuple]:
    """Each prompt on its own, no prefix cache: the reference."""
    llm = _llm(model_dir, batch_invariant, block_size=block_size, enable_prefix_caching=False)
    return [_result(llm.generate([p], _params())[0]) for p in prompts]


CASES = ["together", "batches-of-3", "chunk-7", "chunk-64", "warm-cache", "preemption", "speculative"]


def run_case(model_dir, prompts, case: str, block_size: int, batch_invariant: bool = True) -> list[tuple]:
    if case == "together":
        llm = _llm(model_dir, batch_invariant, block_size=block_size)
        return [_result(o) for o in llm.generate(prompts, _params())]
    if case == "batches-of-3":
        llm = _llm(model_dir, batch_invariant, block_size=block_size)
        return [_result(o) for i in range(0, len(prompts), 3) for o in llm.generate(prompts[i:i + 3], _params())]
    if case in ("chunk-7", "chunk-64", "chunk-512"):
        llm = _llm(model_dir, batch_invariant, block_size=block_size, max_num_batched_tokens=int(case[6:]))
        return [_result(o) for o in llm.generate(prompts, _params())]
    if case == "warm-cache":  # the second pass finds every prompt's full blocks cached
        llm = _llm(model_dir, batch_invariant, block_size=block_size)
        llm.generate(prompts, _params())
        outs = llm.generate(list(reversed(prompts)), _params())
        assert sum(o.num_cached_tokens for o in outs) > 0, "the second pass was meant to hit the cache"
        return [_result(o) for o in reversed(outs)]
    if case == "preemption":
        # at block size 1 a sliding-window layer frees a block for every one it takes: these prompts
        # then never run out, so the blocks are kept there (no KV cache groups; the same bits)
        llm = _llm(model_dir, batch_invariant, block_size=block_size, max_num_batched_tokens=64,
                   num_kv_blocks=200 // block_size, disable_hybrid_kv_cache_manager=block_size == 1)
        outs = llm.generate(prompts, _params())
        assert llm.engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
        return [_result(o) for o in outs]
    if case == "speculative":
        llm = _llm(model_dir, batch_invariant, block_size=block_size, num_speculative_tokens=3)
        outs = llm.generate(prompts, _params())
        # every draft is verified as a multi-token row (the prefill part of the batch); the kept
        # tokens, the bonus token included, take their logits from those rows
        assert llm.engine.scheduler.num_draft_tokens > 0, "drafts were meant to be proposed and verified"
        return [_result(o) for o in outs]
    raise AssertionError(case)


@needs_the_mode
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_mistral", "tiny_qwen2", "tiny_mistral_window", "tiny_qwen3",
                                  "tiny_gemma2", "tiny_gemma3", "tiny_phi3", "tiny_mixtral", "tiny_qwen3_moe"])
def test_batch_invariant_outputs_are_bitwise_the_prompt_alone(request, arch, block_size):
    model_dir = request.getfixturevalue(arch)
    prompts = make_prompts(384, seed=block_size)
    ref = alone(model_dir, prompts, block_size)
    for case in CASES:
        got = run_case(model_dir, prompts, case, block_size)
        for i, (g, r) in enumerate(zip(got, ref)):
            assert g == r, f"{arch} block {block_size} {case}: prompt {i} differs from its run alone"


def test_without_the_mode_outputs_depend_on_the_batch(tiny_llama):
    """What the mode is tested against: without it (``batch_invariant=False``), the prefill and
    decode attention kernels reduce in different orders, so a token's logprobs depend on which
    computed it (here: drafts verified as prefill rows; decoded tokens recomputed by prefill
    after preemption)."""
    prompts = make_prompts(384, seed=16)
    ref = alone(tiny_llama, prompts, 16, batch_invariant=False)
    differing = {case: sum(g != r for g, r in zip(run_case(tiny_llama, prompts, case, 16, batch_invariant=False), ref))
                 for case in ("speculative", "preemption")}
    print(f"default path, prompts whose outputs differ from their run alone: {differing}")
    assert sum(differing.values()) > 0


@pytest.mark.parametrize("kw,match", [
    (dict(cpu_linear="onednn"), r"^batch_invariant: needs cpu_linear 'c'"),
    (dict(cpu_linear="torch"), r"^batch_invariant: needs cpu_linear 'c'"),
    (dict(dtype="float64"), r"^batch_invariant: is implemented for device 'cpu' in float32"),
    (dict(attention_backend="torch"), r"^batch_invariant: needs attention_backend 'cpu'"),
    pytest.param(dict(fused_cpu_ops=False), r"^batch_invariant: needs fused_cpu_ops", marks=needs_the_mode),
])
def test_batch_invariant_refuses_what_it_cannot_make_invariant(tiny_llama, kw, match):
    kw = {"dtype": "float32", **kw}
    with pytest.raises(ValueError, match=match):
        LLM(model=str(tiny_llama), batch_invariant=True, num_kv_blocks=64, **kw)


def test_batch_invariant_must_be_a_bool_or_none():
    from prefixkv.config import EngineConfig

    with pytest.raises(ValueError, match=r"^batch_invariant: must be a bool or None"):
        EngineConfig(batch_invariant="yes")


def test_on_by_default_where_possible(tiny_llama):
    """Unset (None), the mode is on wherever the engine can make it so (CPU float32 with the C
    kernels: it costs <= 3%, bench/RESULTS.md) and off elsewhere, without an error."""
    on = LLM(model=str(tiny_llama), dtype="float32", num_kv_blocks=64)
    assert on.engine.runner.batch_invariant is gemm_available()
    assert on.engine.runner.backend.batch_invariant is gemm_available()
    for kw in (dict(dtype="float64"), dict(dtype="float32", cpu_linear="onednn"),
               dict(dtype="float32", attention_backend="torch"), dict(dtype="float32", batch_invariant=False)):
        assert LLM(model=str(tiny_llama), num_kv_blocks=64, **kw).engine.runner.batch_invariant is False, kw


def test_cli_flags():
    import argparse

    from prefixkv.engine_args import add_engine_args, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args([])).batch_invariant is None
    assert engine_config_from_args(p.parse_args(["--batch-invariant"])).batch_invariant is True
    assert engine_config_from_args(p.parse_args(["--no-batch-invariant"])).batch_invariant is False
