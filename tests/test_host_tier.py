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
    return ModelRunner.bytes_per_block(e.runner.model, e.config.cache.block_size, e.runner.kv_cache.dtype)


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
    kv, tiers = llm.engine.scheduler.kv, llm.engine.scheduler.tiers
    for c in range(12):
        llm.generate(_conversations(12)[c:c + 1], sp)
        assert tiers.host.num_used <= 12
        kv.check_integrity()
    assert tiers.host.num_used == 12 and tiers.host.num_stored > 12  # full, and older entries were replaced
    # least recently used first: the first conversation's own blocks are gone from both tiers (only
    # the shared system prompt is left), while more recently evicted ones come back from the host
    convs = _conversations(12)
    assert kv.match_prefix(convs[0]).num_tokens == len(SYSTEM) and kv.match_prefix(convs[0], lower=True).lower == ()
    assert any(kv.match_prefix(p, lower=True).lower for p in convs[1:])


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
    kv, tiers = llm.engine.scheduler.kv, llm.engine.scheduler.tiers
    assert tiers.host.num_used > 0
    real = llm.engine.runner.execute

    def broken(out):
        raise RuntimeError("injected forward failure")

    llm.engine.runner.execute = broken
    outs = llm.generate(convs[:1], sp)
    assert outs[0].outputs[0].finish_reason == "error"
    assert tiers.host.num_used == 0  # nothing of a failed step (its copies included) can be trusted
    llm.engine.runner.execute = real
    kv.check_integrity()
    got = [o.outputs[0].token_ids for o in llm.generate(convs[:3], sp)]
    assert got == hf_reference(tiny_llama, convs[:3], max_tokens=4)


@pytest.mark.parametrize("disk", [False, True])
def test_deferred_promotions_wait_a_step_while_the_others_run(tiny_llama, tmp_path, disk):
    """The CUDA worker copies promoted blocks on a side stream beside the forward pass
    (``TierConnector.load_async``, set from the worker there; set by hand here, where the worker
    copies at once): a request whose blocks come from a lower tier, or who matches blocks promoted in the same
    step, is admitted with its blocks and copies but computes nothing in that step; the others
    are scheduled; from the next step on it runs. Greedy output equal to transformers'."""
    probe = _llm(tiny_llama, 0.0)
    gb = _bytes_per_block(probe) / (1 << 30)
    kw = dict(kv_disk_cache_dir=str(tmp_path), kv_disk_cache_gb=400 * gb) if disk else {}
    # 48 blocks: room for four at once, not for all eight; no admission cap, as on CUDA (where
    # promotions are deferred and "auto" is no cap)
    llm = LLM(model=str(tiny_llama), dtype="float64", block_size=4, num_kv_blocks=48, max_num_batched_tokens=256,
              kv_host_cache_gb=(6 if disk else 200) * gb, max_admitted_prefill_tokens=None, **kw)
    eng = llm.engine
    eng.check_integrity_each_step = True
    sched = eng.scheduler
    assert sched.tiers.load_async is False  # CPU: the copies run before the forward, nobody waits
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = _conversations(8)
    outs1 = llm.generate(first, sp)
    sched.tiers.load_async = True
    steps = []  # per step: (seq ids whose blocks it copies in, seq ids it schedules)
    real = sched.schedule

    def spy():
        out = real()
        promoted = {b for _, b in out.tiers.loads} | {b for _, b in out.tiers.file_loads}
        readers = {sid for sid, tables in sched.kv.block_tables.items()
                   if any(promoted.intersection(t) for t in tables)}
        steps.append((readers, {s.req.seq_id for s in out.scheduled}, out.tiers.load_async))
        return out

    sched.schedule = spy
    second = [p + o.outputs[0].token_ids + [250, 251, 252] for p, o in zip(first, outs1)]
    fresh = [3 + (i * 11) % 190 for i in range(30)]  # in no tier: computed in the step it comes
    # a new prompt with three returning turns at once (which share promoted system-prompt blocks)
    outs2 = llm.generate([fresh] + second[:3], sp)
    for p in second[3:]:  # then one at a time
        outs2 += llm.generate([p], sp)
    assert all(flag for _, _, flag in steps)
    waited = [(i, readers) for i, (readers, _, _) in enumerate(steps) if readers]
    # every request put off is one whose table holds blocks copied in that step, and vice versa
    assert len(waited) >= 3 and sched.num_deferred_promotions == sum(len(r) for _, r in waited)
    for i, readers in waited:
        assert not readers & steps[i][1], (i, steps[i])  # none of them computes in its copy step
        # each computes later (the next step, or one after it when the token budget ran out first)
        assert readers <= set().union(*(scheduled for _, scheduled, _ in steps[i + 1:])), (i, readers)
    # the others went on meanwhile: the step that copied for the three computed the new prompt
    assert any(scheduled and not readers & scheduled for readers, scheduled, _ in steps[:6] if readers)
    assert eng.stats()["deferred_promotions"] == sched.num_deferred_promotions
    assert sum(o.num_cached_tokens for o in outs2[1:]) > 8 * 40 and eng.stats()["prefix_host_hit_tokens"] > 0
    if disk:
        assert eng.stats()["disk_bytes_read"] > 0
    got = [o.outputs[0].token_ids for o in outs1 + outs2]
    assert got == hf_reference(tiny_llama, first + [fresh] + second, max_tokens=6)
    eng.check_integrity()


def test_a_failed_step_fails_the_requests_it_put_off(tiny_llama):
    """A step that fails after a deferred admission (its copies may not have run) ends that request
    with the error too, frees its blocks and clears the tiers' unlocked blocks; the engine goes on."""
    probe = _llm(tiny_llama, 0.0)
    llm = _llm(tiny_llama, 200 * _bytes_per_block(probe) / (1 << 30))
    eng = llm.engine
    eng.scheduler.tiers.load_async = True
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    convs = _conversations(8)
    outs1 = llm.generate(convs, sp)  # the first conversations end up in the host tier
    second = [p + o.outputs[0].token_ids + [250, 251, 252] for p, o in zip(convs, outs1)]
    real, seen = eng.runner.execute, []

    def broken(out):
        if out.tiers.loads:
            seen.append([r.request_id for r in out.tiers.deferred])
            raise RuntimeError("injected copy failure")
        return real(out)

    eng.runner.execute = broken
    outs = llm.generate(second[:1], sp)
    assert seen == [[outs[0].request_id]]  # its step copied for it and scheduled nothing of it
    assert outs[0].outputs[0].finish_reason == "error" and "injected copy failure" in outs[0].error
    kv = eng.scheduler.kv
    assert kv.num_used_blocks == 0 and eng.scheduler.tiers.host.num_used == 0
    kv.check_integrity()
    eng.runner.execute = real
    got = [o.outputs[0].token_ids for o in llm.generate(second[:2], sp)]
    assert got == hf_reference(tiny_llama, second[:2], max_tokens=4)


def test_max_admitted_prefill_tokens_spreads_deferred_promotions_too(tiny_llama):
    """With the copies beside the forward (``TierConnector.load_async``, the CUDA worker's way; set by hand
    here), a returning turn is admitted a step before it computes: its new tokens count towards
    max_admitted_prefill_tokens in the step that admits it, so returning turns are put off and
    then prefilled one a step, not together. Outputs equal to transformers'."""
    probe = _llm(tiny_llama, 0.0)
    gb = _bytes_per_block(probe) / (1 << 30)
    llm = LLM(model=str(tiny_llama), dtype="float64", block_size=4, num_kv_blocks=48, max_num_batched_tokens=256,
              kv_host_cache_gb=200 * gb, max_admitted_prefill_tokens=4)
    eng, sched = llm.engine, llm.engine.scheduler
    eng.check_integrity_each_step = True
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = _conversations(8)
    outs1 = llm.generate(first, sp)
    sched.tiers.load_async = True
    steps = []  # per step: (seq ids put off, seq ids prefilling: more than one token scheduled)
    real = sched.schedule

    def spy():
        out = real()
        steps.append(({r.seq_id for r in out.tiers.deferred},
                       {s.req.seq_id for s in out.scheduled if s.num_scheduled_tokens > 1}))
        return out

    sched.schedule = spy
    second = [p + o.outputs[0].token_ids + [250, 251, 252] for p, o in zip(first, outs1)]
    outs2 = llm.generate(second[:4], sp)
    assert sched.num_deferred_promotions >= 2  # (the others' blocks were still in the device pool)
    assert all(len(put_off) <= 1 and len(prefilling) <= 1 for put_off, prefilling in steps), steps
    got = [o.outputs[0].token_ids for o in outs2]
    assert got == hf_reference(tiny_llama, second[:4], max_tokens=6)
    eng.check_integrity()
