"""The host-memory KV tier (issue 12, part 1): cached blocks the device pool evicts are copied to
host slots and copied back when a prompt matches them. Lossless (greedy tokens equal transformers'
per-sequence float64 generate), counted as cached tokens, bounded (never more slots than given),
and consistent (``check_integrity`` over both tiers at every step)."""

from __future__ import annotations

import pytest

from prefixkv import LLM, SamplingParams

from test_lossless import hf_reference

SYSTEM = [7 + (i * 5) % 200 for i in range(40)]  # ten blocks of 4


def _conversations(n: int) -> list[list[int]]:
    return [SYSTEM + [210 + c] + [3 + (c * 17 + i * 3) % 200 for i in range(20)] for c in range(n)]


def _llm(model, host_gb: float, **kw):
    return LLM(model=str(model), dtype="float64", block_size=4, num_kv_blocks=40, max_num_batched_tokens=256,
               kv_host_cache_gb=host_gb, **kw)


def _bytes_per_block(llm) -> int:
    from prefixkv.runner.model_runner import ModelRunner

    e = llm.engine
    return ModelRunner.bytes_per_block(e.model, e.config.cache.block_size, e.runner.kv_cache.dtype)


def test_a_conversation_evicted_from_the_device_comes_back_from_host(tiny_llama):
    """Eight conversations of 61 tokens through a 40-block (160-token) device pool: each evicts the
    others. Their second turns find their history in the host tier: cached tokens far beyond what
    the device still holds, outputs token-identical to transformers and to the run without the tier."""
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = _conversations(8)
    probe = _llm(tiny_llama, 0.0)
    host_gb = 200 * _bytes_per_block(probe) / (1 << 30)  # 200 slots: every conversation fits
    for llm in (_llm(tiny_llama, host_gb), probe):
        llm.engine.check_integrity_each_step = True
        outs1 = llm.generate(first, sp)
        second = [p + o.outputs[0].token_ids + [250, 251, 252] for p, o in zip(first, outs1)]
        outs2 = []
        for p in second:  # one at a time: each turn comes back after the others evicted it
            outs2 += llm.generate([p], sp)
        if llm is probe:  # the device alone keeps the shared system prompt, little of each history
            plain = [o.outputs[0].token_ids for o in outs1 + outs2]
            assert sum(o.num_cached_tokens for o in outs2) < tiered_cached - 8 * 16
            continue
        tiered_cached = sum(o.num_cached_tokens for o in outs2)
        stats = llm.engine.stats()
        assert stats["num_host_blocks"] == 200 and 0 < stats["num_host_blocks_used"] <= 200
        assert stats["prefix_host_hit_tokens"] > 0
        for p, o in zip(second, outs2):  # the whole first turn comes back (block-aligned)
            assert o.num_cached_tokens >= (len(p) - 4) // 4 * 4 - 4, (o.num_cached_tokens, len(p))
        tiered = [o.outputs[0].token_ids for o in outs1 + outs2]
        ref = hf_reference(tiny_llama, first + second, max_tokens=6)
        assert tiered == ref
        llm.engine.check_integrity()
    assert tiered == plain


def test_host_capacity_is_strict_and_lru(tiny_llama):
    probe = _llm(tiny_llama, 0.0)
    llm = _llm(tiny_llama, 12 * _bytes_per_block(probe) / (1 << 30))  # 12 slots
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    kv = llm.engine.scheduler.kv
    for c in range(12):
        llm.generate(_conversations(12)[c:c + 1], sp)
        assert kv.host.num_used <= 12
        kv.check_integrity()
    assert kv.host.num_used == 12 and kv.host.num_stored > 12  # full, and older entries were replaced
    # least recently used first: the first conversation's own blocks are gone from both tiers (only
    # the shared system prompt is left), while more recently evicted ones come back from the host
    convs = _conversations(12)
    assert kv.match_prefix(convs[0]).num_tokens == len(SYSTEM) and kv.match_host(convs[0], kv.match_prefix(convs[0])) == []
    assert any(kv.match_host(p, kv.match_prefix(p)) for p in convs[1:])


def test_preemption_and_n_gt_1_with_the_host_tier(tiny_llama):
    probe = _llm(tiny_llama, 0.0)
    llm = LLM(model=str(tiny_llama), dtype="float64", block_size=4, num_kv_blocks=24, max_num_batched_tokens=64,
              kv_host_cache_gb=100 * _bytes_per_block(probe) / (1 << 30))
    llm.engine.check_integrity_each_step = True
    prompts = _conversations(6)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == hf_reference(tiny_llama, prompts, max_tokens=12)
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert again == got and llm.engine.stats()["prefix_host_hit_tokens"] > 0
    sampled = llm.generate(prompts[:2], SamplingParams(max_tokens=8, n=3, temperature=1.0, seed=1, ignore_eos=True))
    assert all(len(o.outputs) == 3 for o in sampled)
    llm.engine.check_integrity()


def test_bad_size_names_the_field(tiny_llama):
    with pytest.raises(ValueError, match="^kv_host_cache_gb:"):
        LLM(model=str(tiny_llama), dtype="float64", num_kv_blocks=16, kv_host_cache_gb=1e-9)
    with pytest.raises(ValueError, match="^kv_host_cache_gb:"):
        LLM(model=str(tiny_llama), dtype="float64", num_kv_blocks=16, kv_host_cache_gb=-1.0)


def test_a_failed_step_clears_the_host_tier_and_the_engine_goes_on(tiny_llama):
    probe = _llm(tiny_llama, 0.0)
    llm = _llm(tiny_llama, 100 * _bytes_per_block(probe) / (1 << 30))
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    convs = _conversations(8)
    llm.generate(convs, sp)
    kv = llm.engine.scheduler.kv
    assert kv.host.num_used > 0
    real = llm.engine.runner.execute

    def broken(out):
        raise RuntimeError("injected forward failure")

    llm.engine.runner.execute = broken
    outs = llm.generate(convs[:1], sp)
    assert outs[0].outputs[0].finish_reason == "error"
    assert kv.host.num_used == 0  # nothing of a failed step (its copies included) can be trusted
    llm.engine.runner.execute = real
    kv.check_integrity()
    got = [o.outputs[0].token_ids for o in llm.generate(convs[:3], sp)]
    assert got == hf_reference(tiny_llama, convs[:3], max_tokens=4)
