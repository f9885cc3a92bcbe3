"""The lossless contract through the lower KV tiers: greedy outputs token-identical to transformers'
per-sequence ``generate`` (float64, CPU) when conversations go down to the host tier or to files
and come back, for models with and without sliding windows, restarts included."""

from __future__ import annotations

import pytest

from prefixkv import LLM, SamplingParams
from test_lossless import MAX_TOKENS, hf_reference, make_prompts

# The lower tiers (host, disk), for models with and without sliding windows: a device pool that cannot
# keep the conversations sends every KV cache group's pages down a tier and brings them back.
TIERED = ["tiny_llama", "tiny_qwen3", "tiny_mistral_window", "tiny_gemma2", "tiny_gemma3"]


def _page_gb(llm) -> float:
    kv = llm.engine.runner.kv_cache  # [layers per page, 2, pages + 1, ...]
    return kv[:, :, 0].numel() * kv.element_size() / (1 << 30)


@pytest.mark.parametrize("arch", TIERED)
@pytest.mark.parametrize("tier,block_size,chunk", [("host", 4, 48), ("disk", 4, 48), ("host", 8, 20)])
def test_lower_tiers_are_invisible(request, arch, tier, block_size, chunk, tmp_path):
    """Eight prompts in a small pool (192 tokens; 64 where every layer is windowed), then each
    conversation's next turn alone, after the others evicted it: every group's pages (the windowed
    groups' too: their windows stay freed) went down to the host tier (or, under an 8-page host
    tier, to files) and come back. Token-identical to transformers' per-sequence generate; with the
    disk tier, again after a restart on the same files. Blocks of 4 tokens and 48-token steps, and
    blocks of 8 with 20-token steps (prefill chunks that end inside a block)."""
    model_dir = request.getfixturevalue(arch)
    first = make_prompts(384, seed=1)[:8]
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    kw = dict(model=str(model_dir), dtype="float64", block_size=block_size, max_num_batched_tokens=chunk,
              num_kv_blocks=(16 if arch == "tiny_mistral_window" else 48) * 4 // block_size)
    gb = _page_gb(LLM(**kw))
    tiers_kw = (dict(kv_host_cache_gb=400 * gb) if tier == "host" else
                dict(kv_host_cache_gb=8 * gb, kv_disk_cache_dir=str(tmp_path), kv_disk_cache_gb=2000 * gb))
    llm = LLM(**kw, **tiers_kw)
    eng = llm.engine
    eng.check_integrity_each_step = True
    windows = eng.runner.kv_plan.windows
    assert any(w is not None for w in windows) == (arch != "tiny_llama")  # windows freed beside the tiers
    outs1 = llm.generate(first, sp)
    second = [p + o.outputs[0].token_ids + [7, 8, 9] for p, o in zip(first, outs1)]
    outs2 = [out for p in second for out in llm.generate([p], sp)]
    assert [o.outputs[0].token_ids for o in outs1 + outs2] == hf_reference(model_dir, first + second)
    assert eng.stats()["prefix_host_hit_tokens"] > 0
    tiers = eng.scheduler.tiers
    keys = set(tiers.host.keys()) | set(tiers.disk.keys() if tiers.disk is not None else ())
    windowed = {g for g, w in enumerate(windows) if w is not None}
    assert windowed <= {g for _, g in keys}  # the windowed groups' pages are in the tier too
    if tier == "disk":
        assert eng.runner.tiers.disk.num_bytes_read > 0
        llm.close()
        again = LLM(**kw, **tiers_kw)
        again.engine.check_integrity_each_step = True
        outs = again.generate(second, sp)
        assert [o.outputs[0].token_ids for o in outs] == hf_reference(model_dir, first + second)[len(first):]
        # (an 8-page host tier drops what a step evicts beyond its 8 slots: not every page reached a file)
        assert sum(o.num_cached_tokens for o in outs) > 0 and again.engine.runner.tiers.disk.num_bytes_read > 0
    eng.check_integrity()
