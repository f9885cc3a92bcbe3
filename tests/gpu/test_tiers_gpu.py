"""The host and disk KV tiers on the GPU path (issue 12): device evictions copied to pinned host
memory and back under load, and files read back into device blocks, on the runner's side stream
beside the forward pass (their requests put off a step); greedy outputs equal to transformers'
(float32, TF32 off) and to a run whose pool holds everything."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("cupy")

from prefixkv import LLM, SamplingParams  # noqa: E402

from gpu.test_engine_gpu import _hf_greedy, gpu_model, no_tf32  # noqa: E402,F401 - (fixtures too)


def _conversations(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 384) for _ in range(60)] for _ in range(n)]


def _per_block_gb(llm) -> float:
    from prefixkv.runner.model_runner import ModelRunner

    e = llm.engine
    return ModelRunner.bytes_per_block(e.runner.model, e.config.cache.block_size, e.runner.kv_cache.dtype) / (1 << 30)


@pytest.mark.parametrize("disk", [False, True])
def test_tiers_under_load_equal_transformers(gpu_model, tmp_path, disk):
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    big = LLM(model=str(gpu_model), device="cuda", dtype="float32", block_size=16, num_kv_blocks=512)
    gb = _per_block_gb(big)
    kw = dict(kv_host_cache_gb=(4 if disk else 200) * gb)
    if disk:
        kw.update(kv_disk_cache_dir=str(tmp_path), kv_disk_cache_gb=400 * gb)
    small = LLM(model=str(gpu_model), device="cuda", dtype="float32", block_size=16, num_kv_blocks=12,
                max_num_seqs=4, **kw)
    first = _conversations(16)
    outs = small.generate(first, sp)  # 16 x 4 blocks through a 12-block pool, four at a time
    second = [p + o.outputs[0].token_ids + [7, 8, 9] for p, o in zip(first, outs)]
    outs2 = small.generate(second, sp)
    st = small.engine.stats()
    assert st["prefix_host_hit_tokens"] > 0 and (not disk or st["disk_bytes_read"] > 0)
    # the promotions went in on the side stream, their requests a step later, beside others' forwards
    assert small.engine.scheduler.tiers.load_async and small.engine.runner.tiers.copy_stream is not None
    assert st["async_promoted_blocks"] > 0 and st["deferred_promotions"] > 0
    got = [o.outputs[0].token_ids for o in outs + outs2]
    assert got == [o.outputs[0].token_ids for o in big.generate(first + second, sp)]
    assert got == _hf_greedy(gpu_model, first + second, 8)
    small.engine.check_integrity()
