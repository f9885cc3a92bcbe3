"""The C decode-attention kernel (prefixkv/csrc/cpu_ops.c) against the token-by-token float64
reference, its exp against torch.exp, and the ``cpu`` backend against the torch one."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kernel_reference import make_batch, reference_attention
from prefixkv.attention import cpu_kernels, get_backend

lib = cpu_kernels.load()
pytestmark = pytest.mark.skipif(lib is None, reason="no C compiler: the cpu backend keeps the torch path")

SPECS = [(1, 1), (15, 1), (16, 1), (17, 1), (64, 1), (250, 1), (33, 1), (2, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("head_dim,block_size,num_kv_heads,group", [
    (64, 16, 3, 3),    # SmolLM2's shapes: the AVX-512 path
    (128, 16, 2, 4),   # the AVX-512 path with D = 128
    (64, 32, 2, 2),    # block 32: the generic path
    (32, 1, 1, 8),     # block 1, D = 32: the generic path
    (80, 4, 4, 1),     # D not a multiple of 16, no GQA
])
def test_decode_kernel_matches_reference(dtype, head_dim, block_size, num_kv_heads, group):
    """Every context length around block boundaries (1, bs - 1, bs, bs + 1, ...); slots outside
    the contexts are NaN, so a read past a sequence's length shows."""
    b = make_batch(dtype, head_dim, block_size, num_kv_heads, group, SPECS, seed=head_dim + block_size)
    seq_lens = torch.tensor([s for s, _ in SPECS], dtype=torch.int32)
    scale = head_dim ** -0.5
    out = cpu_kernels.paged_decode_attention(b["q"], b["cache"], b["block_tables"], seq_lens, scale)
    qsl = torch.arange(len(SPECS) + 1, dtype=torch.int32)
    ref = reference_attention(b["q"], b["cache"], b["block_tables"], seq_lens, qsl, scale)
    assert out.dtype == dtype and not out.isnan().any()
    diff = (out.double() - ref).abs().max().item()
    print(f"{dtype} D={head_dim} bs={block_size} G={group}: max abs diff vs float64 reference {diff:.2e}")
    assert diff < (1e-12 if dtype == torch.float64 else 2e-6)


def test_decode_kernel_rows_do_not_depend_on_the_batch():
    """A sequence's output is bitwise the same alone or with others, in any position."""
    b = make_batch(torch.float32, 64, 16, 3, 3, SPECS, seed=3)
    seq_lens = torch.tensor([s for s, _ in SPECS], dtype=torch.int32)
    full = cpu_kernels.paged_decode_attention(b["q"], b["cache"], b["block_tables"], seq_lens, 0.125)
    for i in range(len(SPECS)):
        one = cpu_kernels.paged_decode_attention(b["q"][i:i + 1], b["cache"], b["block_tables"][i:i + 1],
                                                 seq_lens[i:i + 1], 0.125)
        assert torch.equal(one, full[i:i + 1]), i
    rev = torch.arange(len(SPECS) - 1, -1, -1)
    out = cpu_kernels.paged_decode_attention(b["q"][rev], b["cache"], b["block_tables"][rev], seq_lens[rev], 0.125)
    assert torch.equal(out, full[rev])


def test_softmax_exp_within_2_ulp_of_torch_exp():
    f = lib.softmax_expf_scalar
    f.restype, f.argtypes = ctypes.c_float, [ctypes.c_float]
    xs = torch.cat([torch.linspace(-87.0, 0.0, 20001), torch.tensor([0.0, -1e-8, -0.5, -86.99])])
    ours = torch.tensor([f(float(x)) for x in xs])
    ref = torch.exp(xs.double())
    ulp = ((ours.double() - ref).abs() / (ref * 2.0 ** -23)).max().item()
    print(f"softmax_expf: max error {ulp:.2f} ulp on [-87, 0]")
    assert ulp <= 2.0
    assert f(-1000.0) < 2e-38 and f(float("-inf")) < 2e-38


def test_supports_checks_dtype_device_and_limits():
    kv = torch.zeros(2, 5, 3, 16, 64)
    assert cpu_kernels.supports(torch.zeros(2, 9, 64), kv)
    assert not cpu_kernels.supports(torch.zeros(2, 9, 64, dtype=torch.bfloat16), kv.bfloat16())
    assert not cpu_kernels.supports(torch.zeros(2, 9, 64), kv.double())
    assert not cpu_kernels.supports(torch.zeros(2, 9, 64), torch.zeros(2, 5, 3, 128, 64))  # block > 64
    assert not cpu_kernels.supports(torch.zeros(2, 9, 64), kv.transpose(3, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_backend_equals_torch_backend_on_a_mixed_step(dtype):
    """Decodes through the kernel, prefill chunks through the shared torch path: one forward of a
    step with 5 decodes and 2 prefill chunks, against the torch backend on the same inputs."""
    from prefixkv.attention.base import AttentionMetadata

    specs = [(40, 1), (17, 1), (16, 1), (3, 1), (90, 1), (30, 7), (12, 12)]
    b = make_batch(dtype, 64, 16, 3, 3, specs, seed=11)
    b["cache"] = b["cache"].nan_to_num(0.5)  # the torch path multiplies masked-out values by 0
    # the backends write this step's K/V first: give them the values already in the cache
    qsl = [0]
    for _, ql in specs:
        qsl.append(qsl[-1] + ql)
    slots, ks, vs = [], [], []
    tables = b["block_tables"].tolist()
    for s, (seq_len, ql) in enumerate(specs):
        for pos in range(seq_len - ql, seq_len):
            blk, off = tables[s][pos // 16], pos % 16
            slots.append(blk * 16 + off)
            ks.append(b["cache"][0, blk, :, off])
            vs.append(b["cache"][1, blk, :, off])
    k, v = torch.stack(ks), torch.stack(vs)

    def meta():
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor([s for s, _ in specs], dtype=torch.int32), block_tables=b["block_tables"],
            num_decode_seqs=5, max_seq_len=90, max_query_len=12, seq_lens_cpu=[s for s, _ in specs],
            query_start_loc_cpu=qsl)

    cache_a, cache_b = b["cache"].clone(), b["cache"].clone()
    out_cpu = get_backend("cpu").forward(b["q"], k, v, cache_a, meta(), 0.125)
    out_torch = get_backend("torch").forward(b["q"], k, v, cache_b, meta(), 0.125)
    assert torch.equal(cache_a, cache_b)
    assert torch.equal(out_cpu[5:], out_torch[5:])  # prefill rows: the same code
    torch.testing.assert_close(out_cpu, out_torch, rtol=0, atol=1e-12 if dtype == torch.float64 else 2e-6)
