"""The C decode-attention kernel (prefixkv/csrc/cpu_ops.c) against the token-by-token float64
reference, its exp against torch.exp, and the ``cpu`` backend against the torch one."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kernel_reference import make_batch, reference_attention
from prefixkv import cpu_ops
from prefixkv.attention import get_backend

lib = cpu_ops.load()
pytestmark = pytest.mark.skipif(lib is None, reason="no C compiler: the cpu backend keeps the torch path")

SPECS = [(1, 1), (15, 1), (16, 1), (17, 1), (64, 1), (250, 1), (33, 1), (2, 1), (600, 1)]  # 600: five 128-key chunks


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("head_dim,block_size,num_kv_heads,group", [
    (64, 16, 3, 3),    # SmolLM2's shapes: the AVX-512 / AVX2 path
    (128, 16, 2, 4),   # the AVX-512 / AVX2 path with D = 128
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
    out = cpu_ops.paged_decode_attention(b["q"], b["cache"], b["block_tables"], seq_lens, scale)
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
    full = cpu_ops.paged_decode_attention(b["q"], b["cache"], b["block_tables"], seq_lens, 0.125)
    for i in range(len(SPECS)):
        one = cpu_ops.paged_decode_attention(b["q"][i:i + 1], b["cache"], b["block_tables"][i:i + 1],
                                                 seq_lens[i:i + 1], 0.125)
        assert torch.equal(one, full[i:i + 1]), i
    rev = torch.arange(len(SPECS) - 1, -1, -1)
    out = cpu_ops.paged_decode_attention(b["q"][rev], b["cache"], b["block_tables"][rev], seq_lens[rev], 0.125)
    assert torch.equal(out, full[rev])


GROUP_SPECS = [(140, 20), (145, 5), (250, 10), (40, 40), (135, 9), (1, 1), (300, 3)]  # (seq_len, query tokens)


def _token_rows(block_tables, specs):
    """Each query token of ``specs`` as a decode row (the batch-invariant mode's ``token_rows``):
    its sequence's block-table row and its own context length."""
    tables, lens = [], []
    for s, (seq_len, qlen) in enumerate(specs):
        for i in range(qlen):
            tables.append(block_tables[s])
            lens.append(seq_len - qlen + i + 1)
    return torch.stack(tables).contiguous(), torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("head_dim,group", [(64, 3), (128, 2), (128, 16)])  # 32 heads: smaller groups
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (130, None), (None, 2.0), (17, 30.0)])
def test_decode_rows_of_one_sequence_are_the_bits_of_each_row_alone(head_dim, group, window, softcap):
    """Prefill tokens as decode rows (the batch-invariant mode's ``token_rows``): the kernel takes
    consecutive rows of one block table in groups that share their K/V reads (the AVX-512 kernel a
    chunk of keys at a time, the AVX2 kernel a block at a time); every row is still bitwise the row
    decoded alone (and close to the float64 reference). Contexts cross the 128-key chunks and the
    windows' starts, groups start mid-run, and the second sequence continues the first in its
    blocks (as a prefix-cache hit does), so one group holds rows of both."""
    b = make_batch(torch.float32, head_dim, 16, 2, group, GROUP_SPECS, seed=11)
    b["block_tables"][1, :9] = b["block_tables"][0, :9]  # positions 0 .. 143 (the first's 0 .. 139)
    b["block_tables"] = b["block_tables"].contiguous()
    gen = torch.Generator().manual_seed(5)
    b["cache"][:, b["block_tables"][0, 8], :, 12:] = torch.randn(b["cache"][:, 0, :, 12:].shape, generator=gen)
    tables, lens = _token_rows(b["block_tables"], GROUP_SPECS)
    scale = head_dim ** -0.5
    if window is not None:
        others = [0] + list(range(2, len(GROUP_SPECS)))  # the second's blocks are the first's, then its own
        _nan_before_windows(dict(cache=b["cache"], block_tables=b["block_tables"][others]),
                            [GROUP_SPECS[s] for s in others], window, 16)
    q = b["q"] * 4
    rows = cpu_ops.paged_decode_attention(q, b["cache"], tables, lens, scale, window=window, softcap=softcap)
    assert not rows.isnan().any()
    for t in range(len(lens)):
        alone = cpu_ops.paged_decode_attention(q[t:t + 1], b["cache"], tables[t:t + 1], lens[t:t + 1], scale,
                                               window=window, softcap=softcap)
        assert torch.equal(alone, rows[t:t + 1]), t
    shifted = cpu_ops.paged_decode_attention(q[3:], b["cache"], tables[3:], lens[3:], scale, window=window,
                                             softcap=softcap)  # other group boundaries
    assert torch.equal(shifted, rows[3:])
    ref = reference_attention(q, b["cache"].nan_to_num(), b["block_tables"], b["seq_lens"], b["query_start_loc"],
                              scale, window=window, softcap=softcap)
    assert (rows.double() - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("threads", [1, 3, 5])
def test_decode_rows_each_computed_once_by_any_number_of_threads(threads):
    """The threads claim rows (and prefill groups) from a shared counter, one group ahead of the
    one they compute while more are left than threads: with fewer, as many or more threads than
    groups, every row is written, with the bits of two threads' run."""
    b = make_batch(torch.float32, 64, 16, 3, 3, GROUP_SPECS, seed=13)
    tables, lens = _token_rows(b["block_tables"], GROUP_SPECS)
    q = b["q"]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        ref = cpu_ops.paged_decode_attention(q, b["cache"], tables, lens, 0.125)
        torch.set_num_threads(threads)
        for rows in (slice(None), slice(0, 2), slice(40, 43), slice(len(lens) - 1, None)):
            out = torch.full_like(q[rows], float("nan"))
            cpu_ops.paged_decode_attention(q[rows], b["cache"], tables[rows], lens[rows], 0.125, out=out)
            assert torch.equal(out, ref[rows]), (threads, rows)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_decode_rows_in_any_order_are_the_same_bits(dtype, threads):
    """``order`` (the order the threads claim rows in, ``prefix_order``) moves no bit: the rows in
    turn, reversed (every prefill group split into single rows), a sequence at a time in another
    order (groups kept) and shuffled give each row the same result, and every row is written."""
    b = make_batch(dtype, 64, 16, 3, 3, GROUP_SPECS, seed=17)
    tables, lens = _token_rows(b["block_tables"], GROUP_SPECS)
    n = len(lens)
    starts = [0]
    for _, qlen in GROUP_SPECS:
        starts.append(starts[-1] + qlen)
    by_sequence = [t for s in (4, 1, 6, 0, 3, 5, 2) for t in range(starts[s], starts[s + 1])]
    orders = [torch.arange(n - 1, -1, -1), torch.tensor(by_sequence),
              torch.randperm(n, generator=torch.Generator().manual_seed(2))]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        ref = cpu_ops.paged_decode_attention(b["q"], b["cache"], tables, lens, 0.125)
        assert not ref.isnan().any()
        for order in orders:
            out = torch.full_like(ref, float("nan"))
            cpu_ops.paged_decode_attention(b["q"], b["cache"], tables, lens, 0.125, out=out,
                                           order=order.to(torch.int32))
            assert torch.equal(out, ref), order[:8]
    finally:
        torch.set_num_threads(before)


def test_prefix_order_puts_rows_of_a_shared_prefix_together():
    """Sequences sorted by block table (lexicographically; equal tables in turn); a prefill's tokens
    (batch-invariant rows) together and in order; from a first sequence on, indices from its first
    row."""
    from prefixkv.attention.base import AttentionMetadata, prefix_order

    tables = torch.tensor([[7, 8, 9, 0], [3, 4, 0, 0], [7, 8, 10, 0], [3, 5, 0, 0], [7, 11, 0, 0], [3, 4, 0, 0]],
                          dtype=torch.int32)

    def meta(qlens):
        qsl = [0]
        for q in qlens:
            qsl.append(qsl[-1] + q)
        return AttentionMetadata(slot_mapping=torch.zeros(qsl[-1], dtype=torch.int64),
                                 query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                                 seq_lens=torch.tensor([40] * len(qlens), dtype=torch.int32), block_tables=tables,
                                 num_decode_seqs=sum(q == 1 for q in qlens), max_seq_len=40, max_query_len=max(qlens),
                                 seq_lens_cpu=[40] * len(qlens), query_start_loc_cpu=qsl)

    decodes = meta([1] * 6)
    assert prefix_order(decodes).tolist() == [1, 5, 3, 0, 2, 4]
    assert prefix_order(decodes).dtype == torch.int32
    assert prefix_order(decodes, 0, 3).tolist() == [1, 0, 2]
    # rows: s0 0 | s1 1-3 | s2 4-5 | s3 6 | s4 7-8 | s5 9
    mixed = meta([1, 3, 2, 1, 2, 1])
    assert prefix_order(mixed).tolist() == [1, 2, 3, 9, 6, 0, 4, 5, 7, 8]
    assert prefix_order(mixed, 1).tolist() == [0, 1, 2, 8, 5, 3, 4, 6, 7]
    # ids compared as numbers, not by their low bytes (256 > 1; 257 > 2)
    big = meta([1, 1, 1])
    big.block_tables = torch.tensor([[256, 2], [1, 0], [257, 1]], dtype=torch.int32)
    assert prefix_order(big).tolist() == [1, 0, 2]
    no_blocks = meta([1, 1])
    no_blocks.block_tables = torch.zeros((2, 0), dtype=torch.int32)
    assert prefix_order(no_blocks).tolist() == [0, 1]


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
    assert cpu_ops.supports_decode(torch.zeros(2, 9, 64), kv)
    assert not cpu_ops.supports_decode(torch.zeros(2, 9, 64, dtype=torch.bfloat16), kv.bfloat16())
    assert not cpu_ops.supports_decode(torch.zeros(2, 9, 64), kv.double())
    assert not cpu_ops.supports_decode(torch.zeros(2, 9, 64), torch.zeros(2, 5, 3, 128, 64))  # block > 64
    assert not cpu_ops.supports_decode(torch.zeros(2, 9, 64), kv.transpose(3, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_backend_equals_torch_backend_on_a_mixed_step(dtype):
    """Decodes and (float32) prefill chunks through the kernels: one forward of a step with 5
    decodes and 2 prefill chunks, against the torch backend on the same inputs."""
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
    if dtype == torch.float64:
        assert torch.equal(out_cpu[5:], out_torch[5:])  # prefill rows: the torch path in float64
    torch.testing.assert_close(out_cpu, out_torch, rtol=0, atol=1e-12 if dtype == torch.float64 else 2e-6)


# ---------------------------------------------------------------------------------------- elementwise
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rope_is_bit_identical_to_the_torch_ops(dtype):
    """In place on strided q/k views of one qkv output, exactly ``x * cos + rotate_half(x) * sin``."""
    from prefixkv.model.llama import _rotate_half

    g = torch.Generator().manual_seed(0)
    t, h, kvh, d = 37, 9, 3, 64
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=g, dtype=dtype)
    cos, sin = torch.randn(t, d, generator=g, dtype=dtype), torch.randn(t, d, generator=g, dtype=dtype)
    q = qkv[:, :h * d].view(t, h, d)
    k = qkv[:, h * d:(h + kvh) * d].view(t, kvh, d)
    v_before = qkv[:, (h + kvh) * d:].clone()
    want_q = q * cos[:, None] + _rotate_half(q) * sin[:, None]
    want_k = k * cos[:, None] + _rotate_half(k) * sin[:, None]
    cpu_ops.rope_(q, cos, sin)
    cpu_ops.rope_(k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, (h + kvh) * d:], v_before)  # v untouched


@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rmsnorm_matches_the_torch_norm(with_residual):
    from prefixkv.model.llama import RMSNorm

    g = torch.Generator().manual_seed(1)
    x = torch.randn(70, 576, generator=g)
    res = torch.randn(70, 576, generator=g) if with_residual else None
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=g))
    want_h = x if res is None else x + res
    want = norm(want_h)
    out, h = cpu_ops.add_rmsnorm(x, res, norm.weight.detach(), 1e-5)
    assert torch.equal(h, want_h)  # the residual add itself is exact
    diff = (out - want).abs().max().item()
    print(f"add_rmsnorm vs torch RMSNorm: max abs diff {diff:.2e}")
    torch.testing.assert_close(out, want, rtol=2e-6, atol=2e-6)


def test_silu_mul_matches_torch():
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(2)
    gate_up = torch.randn(33, 2 * 1536, generator=g) * 6
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 88.0, -88.0, 100.0, -100.0, 1e-8, -1e-8])
    gate, up = gate_up.split(1536, dim=1)
    want = F.silu(gate) * up
    out = cpu_ops.silu_mul(gate_up)
    diff = (out - want).abs().max().item()
    print(f"silu_mul vs F.silu * up: max abs diff {diff:.2e}")
    torch.testing.assert_close(out, want, rtol=3e-6, atol=1e-30)


def test_fused_ops_model_matches_plain_model(tiny_llama):
    """The float32 forward with and without the fused C elementwise ops: same greedy tokens,
    logprobs within float32 rounding."""
    from prefixkv import LLM, SamplingParams

    prompts = [[5 + (i * 11 + k) % 300 for i in range(17 + 13 * k)] for k in range(4)]
    res = {}
    for fused in (False, True):
        llm = LLM(model=str(tiny_llama), fused_cpu_ops=fused, block_size=4, num_kv_blocks=256)
        assert llm.engine.runner.model.model.norm.fused is fused
        res[fused] = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, logprobs=0, ignore_eos=True))
    diff = 0.0
    for a, b in zip(res[False], res[True]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        diff = max(diff, max(abs(x.logprob - y.logprob) for x, y in zip(a.outputs[0].token_logprobs, b.outputs[0].token_logprobs)))
    print(f"fused elementwise vs torch ops: max abs diff of chosen logprobs {diff:.2e}")
    assert diff < 1e-4


# ---------------------------------------------------------------------------------------- prefill
PREFILL_SPECS = [(228, 32), (300, 17), (16, 16), (5, 5), (1, 1), (200, 1), (64, 40), (47, 33), (9, 9), (60, 8), (23, 7)]


@pytest.mark.parametrize("head_dim,block_size,num_kv_heads,group", [(64, 16, 3, 3), (128, 16, 2, 4), (64, 32, 1, 9),
                                                                      (64, 1, 2, 2)])
def test_prefill_kernel_matches_reference(head_dim, block_size, num_kv_heads, group):
    """Chunks of every length around the 16-query tile (8 on AVX2), after a cached context or from
    position 0; unused cache slots are NaN, so a read outside a sequence's visible keys shows."""
    b = make_batch(torch.float32, head_dim, block_size, num_kv_heads, group, PREFILL_SPECS, seed=head_dim + block_size)
    out = torch.empty_like(b["q"])
    if not cpu_ops.paged_prefill_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"],
                                           b["query_start_loc"], head_dim ** -0.5, out):
        pytest.skip("no AVX-512 or AVX2 on this CPU: prefill chunks keep the torch path")
    ref = reference_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"], b["query_start_loc"],
                              head_dim ** -0.5)
    diff = (out.double() - ref).abs().max().item()
    print(f"prefill D={head_dim} bs={block_size} G={group}: max abs diff vs float64 reference {diff:.2e}")
    assert not out.isnan().any() and diff < 2e-6


def test_prefill_kernel_result_of_a_query_does_not_depend_on_its_chunk():
    """The same positions computed as one chunk of 40 or as chunks of 7 / 16 / 17: bitwise equal."""
    b = make_batch(torch.float32, 64, 16, 3, 3, [(100, 40)], seed=5)
    whole = torch.empty_like(b["q"])
    if not cpu_ops.paged_prefill_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"],
                                           b["query_start_loc"], 0.125, whole):
        pytest.skip("no AVX-512 or AVX2 on this CPU: prefill chunks keep the torch path")
    for cuts in ([7, 16, 17], [1, 39], [33, 7]):
        start = 60
        pos = 0
        for c in cuts:  # chunk [pos, pos + c) of the 40 queries: context 60 + pos + c
            q = b["q"][pos:pos + c]
            out = torch.empty_like(q)
            cpu_ops.paged_prefill_attention(q, b["cache"], b["block_tables"], torch.tensor([start + pos + c], dtype=torch.int32),
                                            torch.tensor([0, c], dtype=torch.int32), 0.125, out)
            assert torch.equal(out, whole[pos:pos + c]), (cuts, pos)
            pos += c


# ------------------------------------------------------------- sliding windows and soft-capping
def _nan_before_windows(b, specs, window, block_size):
    """NaN in every block wholly before every query's window: a kernel that reads one shows."""
    for s, (seq_len, qlen) in enumerate(specs):
        first_seen = max(0, seq_len - qlen - window + 1)
        for j in range(first_seen // block_size):
            b["cache"][:, b["block_tables"][s, j]] = float("nan")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("head_dim,block_size,group", [(64, 16, 3), (128, 16, 2), (64, 32, 2), (32, 4, 1)])
@pytest.mark.parametrize("window,softcap", [(1, None), (5, None), (17, 30.0), (None, 2.0), (1000, None)])
def test_decode_kernel_window_and_softcap(dtype, head_dim, block_size, group, window, softcap):
    b = make_batch(dtype, head_dim, block_size, 2, group, SPECS, seed=7)
    if window is not None:
        _nan_before_windows(b, SPECS, window, block_size)
    seq_lens = torch.tensor([s for s, _ in SPECS], dtype=torch.int32)
    scale = head_dim ** -0.5
    out = cpu_ops.paged_decode_attention(b["q"] * 4, b["cache"], b["block_tables"], seq_lens, scale,
                                         window=window, softcap=softcap)
    qsl = torch.arange(len(SPECS) + 1, dtype=torch.int32)
    ref = reference_attention(b["q"] * 4, b["cache"].nan_to_num(), b["block_tables"], seq_lens, qsl, scale,
                              window=window, softcap=softcap)
    assert not out.isnan().any()
    # q scaled by 4: larger scores, so float32 rounding a little above the plain tests' 2e-6
    assert (out.double() - ref).abs().max().item() < (1e-12 if dtype == torch.float64 else 1e-5)


@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 16), (64, 1)])
@pytest.mark.parametrize("window,softcap", [(1, None), (9, None), (40, 25.0), (None, 3.0)])
def test_prefill_kernel_window_and_softcap(head_dim, block_size, window, softcap):
    b = make_batch(torch.float32, head_dim, block_size, 2, 2, PREFILL_SPECS, seed=3)
    if window is not None:
        _nan_before_windows(b, PREFILL_SPECS, window, block_size)
    out = torch.empty_like(b["q"])
    q = b["q"] * 4
    if not cpu_ops.paged_prefill_attention(q, b["cache"], b["block_tables"], b["seq_lens"], b["query_start_loc"],
                                           head_dim ** -0.5, out, window=window, softcap=softcap):
        pytest.skip("no AVX-512 or AVX2 on this CPU: prefill chunks keep the torch path")
    ref = reference_attention(q, b["cache"].nan_to_num(), b["block_tables"], b["seq_lens"], b["query_start_loc"],
                              head_dim ** -0.5, window=window, softcap=softcap)
    assert not out.isnan().any() and (out.double() - ref).abs().max().item() < 1e-5


def test_windowed_backend_uses_the_kernels_and_equals_the_torch_path():
    """CpuAttentionBackend with a window and a cap (decodes and prefill chunks in one step) equals
    the torch path's masked attention to float32 rounding, and in batch-invariant mode each
    token's output is bitwise that of the token decoded alone."""
    from prefixkv.attention.base import AttentionMetadata

    specs = [(40, 1), (130, 1), (90, 33), (20, 20)]
    b = make_batch(torch.float32, 64, 16, 2, 3, specs, seed=11)
    qsl = b["query_start_loc"]
    t = int(qsl[-1])
    k = torch.randn(t, 2, 64)
    v = torch.randn(t, 2, 64)
    slots = torch.full((t,), b["cache"].shape[1] * 16 - 1, dtype=torch.int64)  # the dummy block's last slot
    meta = lambda: AttentionMetadata(  # noqa: E731
        slot_mapping=slots, query_start_loc=qsl, seq_lens=b["seq_lens"], block_tables=b["block_tables"],
        num_decode_seqs=2, max_seq_len=b["max_seq_len"], max_query_len=b["max_query_len"],
        seq_lens_cpu=b["seq_lens"].tolist(), query_start_loc_cpu=qsl.tolist())
    cpu, ref = get_backend("cpu"), get_backend("torch")
    got = cpu.forward(b["q"], k, v, b["cache"], meta(), 0.125, window=24, softcap=20.0)
    want = ref.forward(b["q"], k, v, b["cache"], meta(), 0.125, window=24, softcap=20.0)
    assert (got - want).abs().max().item() < 2e-6
    cpu.batch_invariant = True
    inv = cpu.forward(b["q"], k, v, b["cache"], meta(), 0.125, window=24, softcap=20.0)
    assert (inv - want).abs().max().item() < 2e-6
    alone = cpu_ops.paged_decode_attention(b["q"][2:3], b["cache"], b["block_tables"][2:3],
                                           torch.tensor([90 - 33 + 1], dtype=torch.int32), 0.125,
                                           window=24, softcap=20.0)  # the first prefill token, as a decode
    assert torch.equal(inv[2:3], alone)


def test_gelu_tanh_mul_and_softcap_match_torch_and_ignore_their_neighbours():
    """Gemma's GeGLU and final-logit cap in C: within float32 rounding of the torch ops, and a row's
    result bitwise the same alone or inside a larger batch (torch's vectorized tanh is not: a value
    in a vector body and in a scalar tail can round differently)."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(37, 2 * 75, generator=g) * 3
    out = cpu_ops.gelu_tanh_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=1)
    want = F.gelu(gate.double(), approximate="tanh") * up.double()
    assert (out.double() - want).abs().max().item() < 1e-5
    for r in (0, 5, 36):
        assert torch.equal(cpu_ops.gelu_tanh_mul(gate_up[r:r + 1].clone()), out[r:r + 1])
    logits = torch.randn(7, 1001, generator=g) * 40
    capped = cpu_ops.softcap_(logits.clone(), 30.0)
    assert (capped.double() - torch.tanh(logits.double() / 30) * 30).abs().max().item() < 1e-4
    assert torch.equal(cpu_ops.softcap_(logits[3:4].clone(), 30.0), capped[3:4])


# ------------------------------------------------------------------------- KV write and argmax
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("num_tokens", [1, 5, 300])
def test_kv_write_equals_the_torch_scatter(dtype, num_tokens):
    """From strided views into a fused qkv output, bitwise what write_kv (two index_copy_) writes;
    slots < 0 or past the cache are skipped and no other slot changes."""
    from prefixkv.attention.torch_ref import write_kv

    kvh, bs, d, nb1 = 3, 16, 64, 40
    g = torch.Generator().manual_seed(num_tokens)
    qkv = torch.randn(num_tokens, (9 + 2 * kvh) * d, generator=g, dtype=dtype)
    k = qkv[:, 9 * d:(9 + kvh) * d].view(num_tokens, kvh, d)
    v = qkv[:, (9 + kvh) * d:].view(num_tokens, kvh, d)
    slots = torch.randperm(nb1 * bs, generator=g)[:num_tokens].to(torch.int64)
    slots[0] = -1
    if num_tokens > 2:
        slots[2] = nb1 * bs + 3
    cache = torch.full((2, nb1, kvh, bs, d), float("nan"), dtype=dtype)
    want = cache.clone()
    keep = (slots >= 0) & (slots < nb1 * bs)
    write_kv(want, k[keep], v[keep], slots[keep])
    assert cpu_ops.kv_write(k, v, cache, slots)
    assert torch.equal(cache.nan_to_num(7.0), want.nan_to_num(7.0))


def test_kv_write_declines_layouts_it_does_not_take():
    cache = torch.zeros(2, 4, 2, 16, 8)
    k = torch.zeros(3, 2, 8)
    slots = torch.tensor([0, 1, 2])
    assert not cpu_ops.kv_write(k.transpose(1, 2).contiguous().transpose(1, 2), k, cache, slots)  # heads strided
    assert not cpu_ops.kv_write(k.double(), k.double(), cache, slots)  # dtype mismatch
    assert cpu_ops.kv_write(k, k, cache, slots)


def test_argmax_rows_is_torch_argmax():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 1000, generator=g)
    x[1, 10] = x[1, 700] = 50.0           # a tie: the first index
    x[2, 3] = float("nan")                 # NaN: torch.argmax returns it
    x[3] = float("-inf")                   # all -inf: 0
    x[4, 999] = float("inf")
    x[5, :] = 1.0                          # all equal
    x[6, 500] = float("nan")
    x[6, 20] = float("inf")
    wide = torch.randn(9, 3000, generator=g)
    wide[:, :1000] = x
    for t in (x, wide[:, :1000], wide[2:5]):
        assert torch.equal(cpu_ops.argmax_rows(t), t.argmax(dim=-1)), t.shape
    assert cpu_ops.argmax_rows(x.double()) is None and cpu_ops.argmax_rows(x.t()) is None
    assert cpu_ops.argmax_rows(torch.empty(0, 5)).shape == (0,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_copy_kv_blocks_equals_torch_indexing(dtype):
    """The host and disk tiers' block copies (C, straight between the tensors) against torch's
    indexing: every layer's K and V of the given blocks, nothing else touched, through strided
    views too; ids out of range refused."""
    g = torch.Generator().manual_seed(5)
    src = torch.randn(3, 2, 11, 2, 4, 8, generator=g).to(dtype)
    dst = torch.randn(3, 2, 7, 2, 4, 8, generator=g).to(dtype)
    pairs = [(10, 0), (3, 6), (4, 2), (0, 5)]
    want = dst.clone()
    for s, d in pairs:
        want[:, :, d] = src[:, :, s]
    before = src.clone()
    assert cpu_ops.copy_kv_blocks(src, dst, pairs)
    assert torch.equal(dst, want) and torch.equal(src, before)
    with pytest.raises(IndexError, match="out of range"):
        cpu_ops.copy_kv_blocks(src, dst, [(11, 0)])
    with pytest.raises(IndexError, match="out of range"):
        cpu_ops.copy_kv_blocks(src, dst, [(0, 7)])
    assert not cpu_ops.copy_kv_blocks(src, dst.float() if dtype == torch.float64 else dst.double(), pairs)
    # views: a staging tensor [blocks, layers, 2, ...] seen as [layers, 2, blocks, ...], every other block
    staging = torch.zeros(4, 3, 2, 2, 4, 8, dtype=dtype)
    assert cpu_ops.copy_kv_blocks(src, staging.permute(1, 2, 0, 3, 4, 5), [(s, i) for i, (s, _) in enumerate(pairs)])
    assert all(torch.equal(staging[i], src[:, :, s]) for i, (s, _) in enumerate(pairs))
    every_other = torch.zeros(3, 2, 8, 2, 4, 8, dtype=dtype)
    assert cpu_ops.copy_kv_blocks(staging.permute(1, 2, 0, 3, 4, 5), every_other[:, :, ::2], [(0, 3), (2, 1)])
    assert torch.equal(every_other[:, :, 6], src[:, :, 10]) and torch.equal(every_other[:, :, 2], src[:, :, 4])
    assert every_other[:, :, [0, 1, 3, 4, 5, 7]].abs().sum() == 0
    # blocks not contiguous in memory: refused, the caller's torch path
    assert not cpu_ops.copy_kv_blocks(src, dst.transpose(4, 5).contiguous().transpose(4, 5), pairs)
