"""Model-level pieces that the lossless tests cannot see on tiny vocabularies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefixkv.model.llama import _LM_HEAD_SLICE, lm_head


@pytest.mark.parametrize("rows", [1, 2, 7, 16, 33, 64, 130])
@pytest.mark.parametrize("hidden", [96, 576])
def test_sliced_lm_head_is_bit_identical(rows, hidden):
    """The float32 CPU LM head runs over vocabulary slices; every logit must equal F.linear's
    exactly (a vocabulary that is not a multiple of the slice included; SmolLM2's hidden size).
    Observed with MKL's sgemm; another BLAS may round a dot product differently per call shape."""
    g = torch.Generator().manual_seed(rows)
    vocab = 3 * _LM_HEAD_SLICE + 77
    w = torch.randn(vocab, hidden, generator=g)
    h = torch.randn(rows, hidden, generator=g)
    out = lm_head(h, w)
    assert out.shape == (rows, vocab) and out.dtype == torch.float32
    if torch.backends.mkl.is_available():
        assert torch.equal(out, F.linear(h, w))
    else:
        torch.testing.assert_close(out, F.linear(h, w))


def test_float64_lm_head_is_one_matmul(monkeypatch):
    """dgemm is not bit-identical across slicings, so float64 (the exactness tests' dtype) keeps
    the single F.linear call."""
    calls = []
    monkeypatch.setattr(torch, "mm", lambda *a, **k: calls.append(a))
    w = torch.randn(3 * _LM_HEAD_SLICE, 16, dtype=torch.float64)
    h = torch.randn(4, 16, dtype=torch.float64)
    assert torch.equal(lm_head(h, w), F.linear(h, w)) and calls == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rope_table_rows_are_the_computed_values(tiny_llama, dtype):
    """On CPU, cos/sin come from a table of positions 0 .. n - 1 made once by the same ops: every
    row must be the bits computed for that position in a batch of any size (elementwise ops; a
    vector kernel's tail in torch would show here as a last-bit difference). The table grows when
    a position passes its end."""
    from prefixkv import LLM

    model = LLM(model=str(tiny_llama), dtype=str(dtype).removeprefix("torch.")).engine.runner.model
    g = torch.Generator().manual_seed(3)
    for t in [1, 2, 3, 7, 16, 31, 33, 100]:
        for top in (50, 5000, 9000):
            pos = torch.randint(0, top, (t,), generator=g)
            cos, sin = model.rope(pos, dtype, "default", top)
            ref_cos, ref_sin = model.rope(pos, dtype)
            assert cos.dtype == dtype and torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin), (t, top)
    assert model._rope_tables[("default", dtype)][0].shape[0] == 12288  # (9000 rounded up to 4096s)


def test_dtype_auto_resolution():
    from types import SimpleNamespace

    from prefixkv.model.loader import resolve_dtype

    assert resolve_dtype("auto", "cpu", SimpleNamespace(dtype="bfloat16")) == "float32"
    assert resolve_dtype("auto", "cuda", SimpleNamespace(dtype="bfloat16")) == "bfloat16"
    assert resolve_dtype("auto", "cuda", SimpleNamespace(torch_dtype="torch.float16")) == "float16"
    assert resolve_dtype("auto", "cuda", SimpleNamespace(dtype="float32")) == "bfloat16"
    assert resolve_dtype("float64", "cpu", SimpleNamespace()) == "float64"


def test_kv_cache_budget_from_device_memory():
    from prefixkv.runner.memory import kv_cache_bytes_for

    gib = 1 << 30
    # 100 GiB device, 10 GiB in use (weights, others), 2 GiB activation peak, 0.9 utilization
    assert kv_cache_bytes_for(100 * gib, 90 * gib, 0.9, 2 * gib) == 78 * gib
    with pytest.raises(ValueError, match="^gpu_memory_utilization: 0.1 of 100.0 GiB leaves no room"):
        kv_cache_bytes_for(100 * gib, 90 * gib, 0.1, 2 * gib)


def test_loader_streams_and_checks_every_tensor(tiny_llama, tmp_path):
    """Weights are read tensor by tensor; a checkpoint missing a tensor, or holding one the model
    does not have, is refused by name."""
    import shutil

    from safetensors.torch import load_file, save_file

    from prefixkv.model.loader import load_model

    model, _ = load_model(tiny_llama, "float32", "cpu")
    assert not any(p.is_meta for p in model.parameters())
    for case in ("missing", "extra"):
        d = tmp_path / case
        shutil.copytree(tiny_llama, d)
        f = next(d.glob("*.safetensors"))
        sd = load_file(str(f))
        if case == "missing":
            sd.pop("model.layers.1.mlp.down_proj.weight")
        else:
            sd["model.layers.0.self_attn.rotary_bias"] = torch.zeros(3)
        save_file(sd, str(f))
        want = "lacks .*model.layers.1.mlp.down_proj.weight" if case == "missing" else "unexpected tensor 'model.layers.0"
        with pytest.raises(ValueError, match=want):
            load_model(d, "float32", "cpu")
