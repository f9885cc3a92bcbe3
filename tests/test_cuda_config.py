"""The CUDA path's configuration-time decisions, on the CPU: which shapes the kernels take (the
others refused or sent to the torch backend when the engine is built, not at its first step), and
the split-K scratch counted in the KV cache's memory budget."""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch

from prefixkv.attention import backend_for
from prefixkv.attention.cuda import unsupported_reason

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def test_kernels_take_head_dims_80_and_96_and_name_what_they_do_not():
    for dtype in (F16, BF16, F32):
        for head_dim in (32, 64, 80, 96, 128):
            assert unsupported_reason(dtype, head_dim, 32, 8) is None, (dtype, head_dim)
    assert unsupported_reason(BF16, 256, 8, 4) is None
    assert unsupported_reason(F32, 256, 8, 4) == ("head_dim 256 in torch.float32 (the prefill kernel's rows hold "
                                                  "512 bytes)")
    assert unsupported_reason(F16, 48, 8, 4).startswith("head_dim 48 (the kernels take 32, 64, 80, 96, 128, 256)")
    assert unsupported_reason(torch.float64, 64, 8, 4).startswith("dtype torch.float64")
    assert unsupported_reason(F16, 64, 6, 4) == "num_heads 6 with num_kv_heads 4 (not a whole GQA group)"


def test_an_unsupported_shape_is_refused_or_sent_to_torch_at_configuration(caplog):
    """Asked for by name, "cuda" refuses a shape its kernels do not take; as the CUDA device's
    default it gives way to the torch backend and says why."""
    refused = r"^attention_backend: the 'cuda' kernels do not take this model's head_dim 48"
    with pytest.raises(ValueError, match=refused):
        backend_for("cuda", "cpu", F16, 8, 4, 48)
    with caplog.at_level(logging.WARNING, logger="prefixkv.attention"):
        backend = backend_for(None, "cuda", F32, 8, 4, 256)
    assert backend.name == "torch"
    assert "do not take this model's head_dim 256 in torch.float32" in caplog.text
    assert backend_for("cuda", "cpu", BF16, 32, 8, 96).name == "cuda"  # Phi-3's head_dim
    assert backend_for(None, "cpu", F32, 8, 4, 48).name == "cpu"
    assert backend_for("torch", "cuda", F32, 8, 4, 48).name == "torch"


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="cupy is installed here")
def test_cuda_default_without_cupy_fails_at_configuration():
    with pytest.raises(ImportError, match="CuPy"):
        backend_for(None, "cuda", BF16, 32, 8, 128)


def test_engine_refuses_a_shape_the_kernels_do_not_take_when_built(tmp_path):
    """The engine with attention_backend="cuda" and a head_dim of 48: a ValueError from LLM(...),
    not from the first step's kernel launch."""
    from prefixkv import LLM
    from tiny_models import build_model, build_tokenizer

    build_model(tmp_path, "llama", build_tokenizer(tmp_path), head_dim=48)
    with pytest.raises(ValueError, match="^attention_backend: the 'cuda' kernels do not take this model's head_dim 48"):
        LLM(model=str(tmp_path), device="cpu", dtype="float32", attention_backend="cuda", num_kv_blocks=16)


def test_split_k_scratch_peak_is_what_the_largest_split_batch_allocates(monkeypatch):
    """The budget's split-K scratch is the largest decode batch that splits: on 132 SMs with 8 KV
    heads, batches up to 32 (a bucket of 32 x 8 = 256 CTAs < 2 waves); 32 heads of 128 at 128k
    tokens: 32 x 32 x 256 partitions x 130 floats = 130 MiB. Checked against what _decode allocates
    for that batch (and that the next batch size allocates nothing)."""
    from kernel_emu import emulated

    from prefixkv.attention import cuda as kernels
    from prefixkv.runner.memory import split_k_scratch_peak

    peak = split_k_scratch_peak(32, 8, 128, max_num_seqs=256, max_model_len=131072, num_sms=132)
    assert peak == 32 * 32 * 256 * 130 * 4 == 136_314_880
    allocated = []
    scratch = kernels._split_k_scratch

    def spy(*args):
        tensors = scratch(*args)
        allocated.append(sum(t.nbytes for t in tensors))
        return tensors

    monkeypatch.setattr(kernels, "_split_k_scratch", spy)
    cache = torch.empty((2, 4, 8, 16, 128), dtype=BF16)
    for n in (32, 33):
        q = torch.empty((n, 32, 128), dtype=BF16)
        tables = torch.zeros((n, 1), dtype=torch.int32)
        with emulated(None, num_sms=132):
            kernels.paged_decode_attention(q, cache, tables, torch.ones(n, dtype=torch.int32), 0.1, 131072)
    assert allocated == [peak]
    assert split_k_scratch_peak(32, 8, 128, max_num_seqs=256, max_model_len=1024, num_sms=132) == 0  # no split
    assert split_k_scratch_peak(32, 8, 128, max_num_seqs=4, max_model_len=8192, num_sms=132) == 4 * 32 * 16 * 130 * 4


def test_cuda_kv_budget_leaves_room_for_the_split_k_scratch(monkeypatch):
    """The KV cache's bytes on CUDA: the device's budget less what is in use, the profiled
    activation peak and, with the CUDA attention backend, the split-K scratch."""
    import types

    from prefixkv.runner import memory

    gib = 1 << 30
    shape = types.SimpleNamespace(num_heads=32, num_kv_heads=8, head_dim=128)
    model = types.SimpleNamespace(shape=shape)
    monkeypatch.setattr(memory, "profile_activation_peak", lambda m, t, s: 2 * gib)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (60 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(multi_processor_count=132))
    base = int(0.9 * 80 * gib) - 20 * gib - 2 * gib
    assert memory.cuda_kv_cache_bytes(model, "torch", 0.9, 8192, 256, 131072) == base
    assert memory.cuda_kv_cache_bytes(model, "cuda", 0.9, 8192, 256, 131072) == base - 136_314_880
