"""The decoder's GEMMs: oneDNN on prepacked weights (CPU float32) against the plain F.linear path,
fused projections against separate ones, and where each path is used."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefixkv.model.linear import FusedLinear, Linear, onednn_available

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")


def _linear(n_in: int, n_out: int, bias: bool, seed: int, dtype=torch.float32) -> Linear:
    g = torch.Generator().manual_seed(seed)
    m = Linear(n_in, n_out, bias)
    m.weight = torch.nn.Parameter(torch.randn(n_out, n_in, generator=g, dtype=dtype) * 0.05, requires_grad=False)
    if bias:
        m.bias = torch.nn.Parameter(torch.randn(n_out, generator=g, dtype=dtype), requires_grad=False)
    return m


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n_in,n_out", [(576, 960), (1536, 576), (96, 49152 // 16)])
def test_prepacked_linear_matches_f_linear(n_in, n_out, bias):
    """float32 rounding apart, the same values as F.linear (the plain path, MKL)."""
    m = _linear(n_in, n_out, bias, seed=n_in + n_out)
    w, b = m.weight.clone(), None if m.bias is None else m.bias.clone()
    x = torch.randn(130, n_in, generator=torch.Generator().manual_seed(1))
    ref = F.linear(x, w, b)
    m.prepack()
    assert m.weight is None and m.packed is not None
    out = m(x)
    diff = (out - ref).abs().max().item()
    print(f"prepacked vs F.linear {n_in}->{n_out} bias={bias}: max abs diff {diff:.3e}")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("n_in,n_out", [(576, 960), (1536, 576), (576, 3072)])
def test_prepacked_linear_rows_do_not_depend_on_the_batch(n_in, n_out):
    """Measured on this machine's oneDNN (what batch-invariant work can build on): from 2 rows up, a
    row's output is bitwise the same whatever the number of rows in the call. A single row with
    K = 1536 takes another kernel (it differs in the last bit), so M = 1 is left out."""
    m = _linear(n_in, n_out, False, seed=7)
    m.prepack()
    x = torch.randn(512, n_in, generator=torch.Generator().manual_seed(2))
    full = m(x)
    for rows in (2, 3, 7, 16, 17, 64, 129, 300):
        assert torch.equal(m(x[:rows]), full[:rows]), rows
    assert torch.equal(m(x[100:117]), full[100:117])


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_projections_equal_separate_ones_bitwise(pack, bias):
    """q/k/v (and gate/up) as one GEMM: every column is the same dot product as in its own GEMM."""
    if pack and not onednn_available():
        pytest.skip("torch built without oneDNN")
    parts = [_linear(576, n, bias, seed=i) for i, n in enumerate((576, 192, 192))]
    x = torch.randn(37, 576, generator=torch.Generator().manual_seed(3))
    fused = FusedLinear.from_parts(parts)
    assert fused.part_sizes == [576, 192, 192]
    if pack:
        for p in parts:
            p.prepack()
        fused.prepack()
    for got, part in zip(fused(x), parts):
        assert torch.equal(got, part(x))


def test_float64_keeps_f_linear():
    """The exact (float64) lossless matrix runs the plain path: F.linear, bit for bit."""
    m = _linear(64, 48, True, seed=5, dtype=torch.float64)
    x = torch.randn(9, 64, dtype=torch.float64)
    assert torch.equal(m(x), F.linear(x, m.weight, m.bias))


def _tiny_model(path, dtype: str, cpu_linear: str):
    from prefixkv.model.loader import load_model

    return load_model(path, dtype, "cpu", prepack=cpu_linear == "onednn")[0]


@needs_onednn
def test_model_prepacks_only_cpu_float32(tiny_llama):
    m32 = _tiny_model(tiny_llama, "float32", "onednn")
    lin = [m for m in m32.modules() if isinstance(m, Linear)]
    assert lin and all(m.packed is not None and m.weight is None for m in lin)
    assert m32.packed_lm_head is not None and not hasattr(m32, "lm_head")
    plain = _tiny_model(tiny_llama, "float32", "torch")
    assert all(m.packed is None for m in plain.modules() if isinstance(m, Linear)) and plain.packed_lm_head is None
    m64 = _tiny_model(tiny_llama, "float64", "onednn")
    assert all(m.packed is None for m in m64.modules() if isinstance(m, Linear)) and m64.packed_lm_head is None
    # fused projections either way: one GEMM for q/k/v and one for gate/up per layer
    layer = m64.model.layers[0]
    assert hasattr(layer.self_attn, "qkv_proj") and not hasattr(layer.self_attn, "q_proj")
    assert hasattr(layer.mlp, "gate_up_proj") and not hasattr(layer.mlp, "up_proj")


@needs_onednn
def test_prepacked_model_logits_close_to_plain_and_same_greedy_tokens(tiny_llama, tiny_qwen2):
    """The whole float32 forward on prepacked GEMMs against the plain path: logits within float32
    rounding (max abs diff printed) and the same greedy tokens from the engine."""
    from prefixkv import LLM, SamplingParams

    prompts = [[5 + (i * 7 + k) % 300 for i in range(20 + 9 * k)] for k in range(4)]
    for path in (tiny_llama, tiny_qwen2):
        outs = {}
        for cl in ("torch", "onednn"):
            llm = LLM(model=str(path), cpu_linear=cl, block_size=4, num_kv_blocks=256)
            res = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, logprobs=0, ignore_eos=True))
            outs[cl] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in res]
        diff = 0.0
        for (ta, la), (tb, lb) in zip(outs["torch"], outs["onednn"]):
            assert ta == tb
            diff = max(diff, max(abs(a.logprob - b.logprob) for a, b in zip(la, lb)))
        print(f"{path.name}: max abs diff of chosen logprobs, oneDNN vs F.linear: {diff:.3e}")
        assert diff < 1e-4
