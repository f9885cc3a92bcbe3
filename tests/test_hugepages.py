"""Host tensors on transparent huge pages (prefixkv/hugepages.py): the same tensors, with the
kernel's advice taken for their 2 MB-aligned part, and a plain tensor where that is not possible."""

import torch

import pytest

from prefixkv import hugepages


def _vma_flags(addr: int) -> dict[str, str]:
    """The /proc/self/smaps entry of the mapping holding ``addr``."""
    found, fields = False, {}
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                if found:
                    break
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = lo <= addr < hi
            elif found:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    return fields


def _advised(t: torch.Tensor) -> bool:
    """Whether the mapping holding ``t``'s first aligned huge page took MADV_HUGEPAGE (VmFlags ``hg``)."""
    inside = -(-t.data_ptr() // hugepages.HUGE_PAGE) * hugepages.HUGE_PAGE + 4096
    return "hg" in _vma_flags(inside).get("VmFlags", "").split()


needs_thp = pytest.mark.skipif(not hugepages.available(), reason="no transparent huge pages here")


@needs_thp
def test_empty_is_a_plain_tensor_whose_aligned_part_is_advised():
    t = hugepages.empty((3, 5 << 20), dtype=torch.float32)  # 60 MB
    assert t.shape == (3, 5 << 20) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.untyped_storage().nbytes() == t.numel() * 4  # no slack, not a view
    t.fill_(2.5)
    assert torch.equal(t, torch.full((3, 5 << 20), 2.5))
    vma = _vma_flags(-(-t.data_ptr() // hugepages.HUGE_PAGE) * hugepages.HUGE_PAGE + 4096)
    assert vma.get("THPeligible") == "1", vma
    assert _advised(t), vma  # MADV_HUGEPAGE taken


def test_small_tensors_and_switched_off_are_left_alone(monkeypatch):
    small = hugepages.empty((100,), dtype=torch.float64)
    assert small.shape == (100,) and small.dtype == torch.float64
    assert not hugepages.advise(small)
    assert not hugepages.advise(torch.empty(1 << 22)[::2])  # not contiguous
    monkeypatch.setenv("PREFIXKV_HUGEPAGES", "0")
    assert not hugepages.available()
    big = hugepages.empty((4 << 20,))
    assert big.shape == (4 << 20,) and not hugepages.advise(big)


@needs_thp
def test_cpu_kv_cache_and_packed_weights_are_advised(tiny_llama):
    """The buffers a CPU decode step streams: the KV cache (zeroed) and the packed GEMM weights."""
    from prefixkv import LLM, cpu_ops

    llm = LLM(model=str(tiny_llama), dtype="float32", num_kv_blocks=4096, block_size=16)
    kv = llm.engine.runner.kv_cache
    assert kv.numel() * kv.element_size() >= 4 * hugepages.HUGE_PAGE and not kv.any()
    assert _advised(kv)
    if cpu_ops.gemm_available():
        assert _advised(cpu_ops.gemm_pack(torch.randn(4096, 1024)))


def test_a_models_packed_weights_share_one_arena(tiny_llama):
    """Every packed GEMM weight of a model (the small q/k/v, o and down projections too, which alone
    would stay in 4 KB pages) is a cache-line-aligned slice of one huge-page arena, packed exactly as
    on its own."""
    from prefixkv import LLM, cpu_ops
    from prefixkv.model.linear import Linear

    if not cpu_ops.gemm_available():
        pytest.skip("no C GEMM in this build")
    llm = LLM(model=str(tiny_llama), dtype="float32")
    m = llm.engine.runner.model
    packed = [mod.packed for mod in m.modules() if isinstance(mod, Linear) and mod.kind == "c"]
    assert len(packed) == 4 * m.shape.num_layers + 1  # qkv, o, gate_up, down per layer; the LM head
    bases = {p.untyped_storage().data_ptr() for p in packed}
    assert len(bases) == 1 and all(p.data_ptr() % 64 == 0 for p in packed)
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * 4) for p in packed)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no two overlap
    w = torch.randn(96, 40)
    arena = torch.empty(cpu_ops.gemm_packed_numel(96, 40) + 5)
    assert torch.equal(cpu_ops.gemm_pack(w, out=arena[5:]), cpu_ops.gemm_pack(w))
