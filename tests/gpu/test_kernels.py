"""The CUDA kernels (prefixkv.attention.cuda) against a plain float64 reference that walks each
sequence's block table token by token.

Cache slots outside every sequence's context hold NaN, so a kernel that reads past a context (or
multiplies a masked-out value by zero instead of skipping it) fails loudly. Block ids are shuffled,
contexts are ragged, and decodes and prefill chunks (with cached prefixes) share batches.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("cupy")

from prefixkv.attention import cuda as kernels  # noqa: E402
from prefixkv.attention.base import AttentionMetadata  # noqa: E402

DEVICE = torch.device("cuda")
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
# Inputs are rounded identically for kernel and reference; the error left is the output rounding
# (and, on the tensor-core path, P rounded to the input dtype as in FlashAttention-2).
TOL = {F16: 5e-3, BF16: 3e-2, F32: 1e-4}


# ---- reference and inputs ------------------------------------------------------------------------


def reference_attention(q, kv_cache_layer, block_tables, seq_lens, query_start_loc, scale, first_seq=0):
    """float64 causal attention of every query token, K/V gathered token by token via the block table.
    Rows of sequences before ``first_seq`` stay zero."""
    q = q.detach().cpu().double()
    cache = kv_cache_layer.detach().cpu()
    num_heads, (num_kv_heads, block_size) = q.shape[1], cache.shape[2:4]
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    tables = block_tables.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        if s < first_seq:
            continue
        q0, q1 = starts[s], starts[s + 1]
        ctx = seq_len - (q1 - q0)
        keys, values = [], []
        for pos in range(seq_len):
            block, offset = tables[s][pos // block_size], pos % block_size
            keys.append(cache[0, block, :, offset])
            values.append(cache[1, block, :, offset])
        k = torch.stack(keys).double().repeat_interleave(num_heads // num_kv_heads, dim=1)  # [seq_len, H, D]
        v = torch.stack(values).double().repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", q[q0:q1], k) * scale
        query_pos = ctx + torch.arange(q1 - q0)[:, None]
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > query_pos, float("-inf"))
        out[q0:q1] = torch.einsum("hnl,lhd->nhd", torch.softmax(scores, dim=-1), v)
    return out


def make_batch(dtype, head_dim, block_size, num_kv_heads, queries_per_kv, specs, seed=0):
    """specs: [(seq_len, query_len)], decodes (query_len 1) first. The contexts' K/V are in the cache
    (random, shuffled blocks); every other slot is NaN. Returns a dict of device tensors."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-seq_len // block_size) for seq_len, _ in specs]
    num_blocks = sum(blocks_per_seq) + 3
    cache = torch.full((2, num_blocks + 1, num_kv_heads, block_size, head_dim), float("nan"))
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros((len(specs), max(blocks_per_seq) + 2), dtype=torch.int32)  # padded with 0
    for s, (seq_len, _) in enumerate(specs):
        blocks, perm = perm[: blocks_per_seq[s]], perm[blocks_per_seq[s]:]
        tables[s, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        for pos in range(seq_len):
            cache[:, blocks[pos // block_size], :, pos % block_size] = torch.randn(
                (2, num_kv_heads, head_dim), generator=gen)
    query_start_loc = [0]
    for _, query_len in specs:
        query_start_loc.append(query_start_loc[-1] + query_len)
    q = torch.randn((query_start_loc[-1], num_kv_heads * queries_per_kv, head_dim), generator=gen)
    num_decodes = next((i for i, (_, ql) in enumerate(specs) if ql != 1), len(specs))
    return dict(
        cache=cache.to(dtype).to(DEVICE), q=q.to(dtype).to(DEVICE), block_tables=tables.to(DEVICE),
        seq_lens=torch.tensor([L for L, _ in specs], dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=DEVICE),
        num_decodes=num_decodes, max_seq_len=max(L for L, _ in specs), max_query_len=max(ql for _, ql in specs),
    )


def assert_close(got, want, dtype, rows=None):
    got = got.detach().cpu().double()
    if rows is not None:
        got, want = got[rows], want[rows]
    assert not got.isnan().any(), "NaN in the kernel output"
    tol = TOL[dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# ---- decode ----------------------------------------------------------------------------------------

DECODE_CASES = [
    # dtype, head_dim, block_size, num_kv_heads, queries_per_kv, split_k
    (F16, 128, 16, 2, 4, False),
    (BF16, 128, 32, 2, 8, True),
    (F32, 64, 16, 2, 1, None),  # a 1500-token context with few CTAs: automatic split-K
    (BF16, 64, 16, 4, 1, False),
    (F16, 64, 32, 1, 8, True),
    (F32, 128, 32, 1, 4, True),
    (BF16, 128, 16, 1, 12, False),  # GQA group split into 2 chunks of 6 heads
    (F16, 128, 16, 1, 16, None),  # 2 chunks of 8
    (BF16, 64, 8, 2, 7, True),
    (F16, 64, 64, 1, 5, False),
    (BF16, 256, 16, 1, 2, True),
    (F32, 32, 16, 1, 3, False),
]


@pytest.mark.parametrize("dtype,head_dim,block_size,num_kv_heads,queries_per_kv,split_k", DECODE_CASES)
def test_paged_decode(dtype, head_dim, block_size, num_kv_heads, queries_per_kv, split_k):
    rng = random.Random(head_dim * 1000 + block_size * 10 + queries_per_kv)
    lens = [1, block_size, block_size + 1, rng.randint(2, 700), 1500, rng.randint(500, 1100)]
    b = make_batch(dtype, head_dim, block_size, num_kv_heads, queries_per_kv, [(L, 1) for L in lens])
    scale = 1 / math.sqrt(head_dim)
    out = kernels.paged_decode_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"], scale,
                                         b["max_seq_len"], split_k=split_k)
    want = reference_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"], b["query_start_loc"], scale)
    assert_close(out, want, dtype)


def test_paged_decode_split_k_grid_sized_by_an_upper_bound():
    """A grid sized for 4096 tokens (as a CUDA graph captured for long contexts would be) still
    gives the right answer for short sequences: partitions past a sequence's end do nothing."""
    b = make_batch(BF16, 128, 16, 2, 4, [(L, 1) for L in (3, 600, 1030)])
    out = kernels.paged_decode_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"], 0.1, 4096,
                                         split_k=True)
    want = reference_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"], b["query_start_loc"], 0.1)
    assert_close(out, want, BF16)


# ---- prefill ---------------------------------------------------------------------------------------

PREFILL_SPECS = [(37, 37), (300, 45), (1100, 1), (600, 260), (64, 64)]  # fresh, prefix hits, last token
PREFILL_CASES = [
    # dtype, head_dim, block_size, num_kv_heads, queries_per_kv, impl
    (F16, 128, 16, 2, 4, "mma"),
    (BF16, 128, 32, 2, 4, "mma"),
    (F16, 64, 16, 4, 1, "mma"),
    (BF16, 64, 32, 1, 8, "mma"),
    (F16, 128, 16, 2, 4, "simt"),
    (BF16, 64, 16, 1, 8, "simt"),
    (F32, 128, 16, 2, 4, "auto"),
    (F32, 64, 32, 1, 1, "simt"),
    (BF16, 128, 16, 1, 7, "auto"),  # 7 heads x 9 tokens per CTA, one padding row
    (F16, 128, 32, 1, 12, "simt"),
    (BF16, 256, 16, 1, 2, "auto"),  # SIMT with 32-row tiles
    (F16, 64, 8, 1, 80, "mma"),  # 80 query heads per kv head: 2 head chunks
    (F32, 32, 16, 1, 2, "simt"),
]


@pytest.mark.parametrize("dtype,head_dim,block_size,num_kv_heads,queries_per_kv,impl", PREFILL_CASES)
def test_paged_prefill(dtype, head_dim, block_size, num_kv_heads, queries_per_kv, impl):
    b = make_batch(dtype, head_dim, block_size, num_kv_heads, queries_per_kv, PREFILL_SPECS, seed=head_dim)
    scale = 1 / math.sqrt(head_dim)
    out = kernels.paged_prefill_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"],
                                          b["query_start_loc"], scale, b["max_query_len"], impl=impl)
    want = reference_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"], b["query_start_loc"], scale)
    assert_close(out, want, dtype)


def test_paged_prefill_first_seq_leaves_earlier_rows_alone():
    b = make_batch(F16, 64, 16, 2, 2, [(10, 1), (20, 1), (50, 30)])
    out = torch.full_like(b["q"], 7.0)
    kernels.paged_prefill_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"], b["query_start_loc"],
                                    0.125, b["max_query_len"], first_seq=2, out=out)
    want = reference_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"], b["query_start_loc"], 0.125,
                               first_seq=2)
    assert (out[:2] == 7.0).all()
    assert_close(out, want, F16, rows=slice(2, None))


# ---- KV write and block copy -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F16, BF16, F32])
@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv(dtype, block_size):
    num_blocks, num_kv_heads, head_dim, num_tokens = 6, 2, 64, 9
    cache = torch.randn((2, num_blocks + 1, num_kv_heads, block_size, head_dim)).to(dtype).to(DEVICE)
    # k and v are strided views of a fused [num_tokens, 3, num_kv_heads, head_dim] buffer
    fused = torch.randn((num_tokens, 3, num_kv_heads, head_dim)).to(dtype).to(DEVICE)
    k, v = fused[:, 0], fused[:, 2]
    slots = random.Random(block_size).sample(range((num_blocks + 1) * block_size), num_tokens - 1) + [-1]
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    want = cache.clone()
    for t, slot in enumerate(slots):
        if slot >= 0:
            want[0, slot // block_size, :, slot % block_size] = k[t]
            want[1, slot // block_size, :, slot % block_size] = v[t]
    kernels.write_kv(k, v, cache, slot_mapping)
    assert same_bits(cache, want)


@pytest.mark.parametrize("dtype", [F16, BF16, F32])
def test_copy_blocks_all_layers_one_launch(dtype):
    kv_cache = torch.randn((3, 2, 9, 2, 16, 64)).to(dtype).to(DEVICE)
    src_dst = torch.tensor([[1, 5], [2, 7], [8, 0]], dtype=torch.int64)  # on the CPU: moved by the wrapper
    want = kv_cache.clone()
    want[:, :, src_dst[:, 1]] = want[:, :, src_dst[:, 0]]
    kernels.copy_blocks(kv_cache, src_dst)
    assert same_bits(kv_cache, want)
    kernels.CudaAttentionBackend().copy_blocks(kv_cache, torch.empty((0, 2), dtype=torch.int64))
    assert same_bits(kv_cache, want)


# ---- the backend ---------------------------------------------------------------------------------------

FORWARD_CASES = [
    # dtype, head_dim, block_size, num_kv_heads, queries_per_kv, specs
    (BF16, 128, 16, 4, 4, [(30, 1), (1800, 1), (9, 1), (40, 17), (20, 20), (300, 100)]),
    (F16, 64, 32, 2, 1, [(5, 1), (70, 30), (33, 33)]),
    (F32, 128, 16, 1, 8, [(1, 1), (1200, 1), (100, 1)]),
]


def _forward_inputs(dtype, head_dim, block_size, num_kv_heads, queries_per_kv, specs, seed=0):
    """A batch plus this step's k/v: q, k, v are views of one fused qkv projection (strided rows)."""
    b = make_batch(dtype, head_dim, block_size, num_kv_heads, queries_per_kv, specs, seed)
    num_tokens, num_heads = b["q"].shape[:2]
    qkv = torch.randn((num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)).to(dtype).to(DEVICE)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    q.copy_(b["q"])
    k = qkv[:, num_heads * head_dim: (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    tables = b["block_tables"].tolist()
    slots = [tables[s][pos // block_size] * block_size + pos % block_size
             for s, (seq_len, query_len) in enumerate(specs) for pos in range(seq_len - query_len, seq_len)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE), query_start_loc=b["query_start_loc"],
        seq_lens=b["seq_lens"], block_tables=b["block_tables"], num_decode_seqs=b["num_decodes"],
        max_seq_len=b["max_seq_len"], max_query_len=b["max_query_len"])
    want_cache = b["cache"].clone()
    for t, slot in enumerate(slots):
        want_cache[0, slot // block_size, :, slot % block_size] = k[t]
        want_cache[1, slot // block_size, :, slot % block_size] = v[t]
    return b, q, k, v, meta, want_cache


@pytest.mark.parametrize("dtype,head_dim,block_size,num_kv_heads,queries_per_kv,specs", FORWARD_CASES)
def test_backend_forward_mixed_batch(dtype, head_dim, block_size, num_kv_heads, queries_per_kv, specs):
    b, q, k, v, meta, want_cache = _forward_inputs(dtype, head_dim, block_size, num_kv_heads, queries_per_kv, specs)
    scale = 1 / math.sqrt(head_dim)
    out = kernels.CudaAttentionBackend().forward(q, k, v, b["cache"], meta, scale)
    assert same_bits(b["cache"], want_cache), "forward wrote outside slot_mapping, or wrote wrong values"
    want = reference_attention(q, want_cache, b["block_tables"], b["seq_lens"], b["query_start_loc"], scale)
    assert_close(out, want, dtype)


def test_backend_forward_replays_in_a_cuda_graph():
    """Capture decode + prefill (split-K forced, so scratch is allocated inside the capture), then
    replay after changing the inputs in place: the graph must compute the new answer."""
    specs = [(700, 1), (1500, 1), (90, 40)]
    b, q, k, v, meta, _ = _forward_inputs(BF16, 128, 16, 2, 4, specs)
    backend = kernels.CudaAttentionBackend(split_k=True)
    cache = b["cache"]
    backend.forward(q, k, v, cache.clone(), meta, 0.1)  # warm-up: compiles the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, cache, meta, 0.1)
    for t in (q, k, v):
        t.copy_(torch.randn(t.shape).to(t.dtype))
    graph.replay()
    torch.cuda.synchronize()
    want = reference_attention(q, cache, b["block_tables"], b["seq_lens"], b["query_start_loc"], 0.1)
    assert_close(out, want, BF16)


def test_wrapper_rejects_bad_shapes_with_clear_messages():
    b = make_batch(F16, 64, 16, 2, 2, [(10, 1)])
    with pytest.raises(ValueError, match="head_dim"):
        kernels.paged_decode_attention(b["q"][..., :32], b["cache"], b["block_tables"], b["seq_lens"], 1.0, 10)
    with pytest.raises(ValueError, match="dtype"):
        kernels.paged_decode_attention(b["q"].float(), b["cache"], b["block_tables"], b["seq_lens"], 1.0, 10)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        kernels.paged_decode_attention(b["q"][:, :3], b["cache"], b["block_tables"], b["seq_lens"], 1.0, 10)
    with pytest.raises(ValueError, match="block_tables"):
        kernels.paged_decode_attention(b["q"], b["cache"], b["block_tables"].long(), b["seq_lens"], 1.0, 10)
    with pytest.raises(ValueError, match="impl"):
        kernels.paged_prefill_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"], b["query_start_loc"],
                                        1.0, 1, impl="fast")
