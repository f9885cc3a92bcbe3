"""The CUDA kernels (prefixkv.attention.cuda) against a plain float64 reference that walks each
sequence's block table token by token (tests/kernel_reference.py; the same cases also run on the
CPU through the SIMT emulator in tests/test_kernel_emulation.py).

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

from kernel_reference import forward_inputs, make_batch as _make_batch, reference_attention  # noqa: E402

DEVICE = torch.device("cuda")


def make_batch(*args, **kwargs):
    return _make_batch(*args, device=DEVICE, **kwargs)


F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
# Inputs are rounded identically for kernel and reference; the error left is the output rounding
# (and, on the tensor-core path, P rounded to the input dtype as in FlashAttention-2).
TOL = {F16: 5e-3, BF16: 3e-2, F32: 1e-4}


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
    (F16, 80, 16, 2, 4, False),  # head_dim 80 / 96: V dims on 20 / 24 lanes
    (BF16, 80, 16, 1, 8, True),
    (BF16, 96, 16, 2, 3, None),
    (F32, 96, 32, 1, 4, True),
]


@pytest.mark.parametrize("dtype,head_dim,block_size,num_kv_heads,queries_per_kv,split_k", DECODE_CASES)
def test_paged_decode(dtype, head_dim, block_size, num_kv_heads, queries_per_kv, split_k):
    rng = random.Random(head_dim * 1000 + block_size * 10 + queries_per_kv)
    lens = [1, block_size, block_size + 1, rng.randint(2, 700), 1500, rng.randint(500, 1100), 512, 513]
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


@pytest.mark.parametrize("split_k", [False, True])
def test_paged_decode_empty_context_rows_are_zero(split_k):
    b = make_batch(BF16, 128, 32, 2, 8, [(L, 1) for L in (5, 600, 1)])
    b["seq_lens"][1] = 0
    out = kernels.paged_decode_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"], 0.1, 600,
                                         split_k=split_k)
    want = reference_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"], b["query_start_loc"], 0.1)
    assert (out[1] == 0).all()
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
    (F16, 80, 16, 2, 4, "mma"),  # head_dim 80 / 96 (Phi-3 and others)
    (BF16, 96, 16, 1, 3, "mma"),
    (F16, 80, 16, 2, 2, "simt"),  # 4-byte shared columns
    (BF16, 96, 16, 1, 4, "auto"),
    (F32, 80, 16, 1, 2, "simt"),
    (F32, 96, 32, 2, 1, "auto"),
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
    # random slots (the dummy block's included), then one skipped (-1) and one past the cache
    slots = random.Random(block_size).sample(range((num_blocks + 1) * block_size), num_tokens - 2)
    slots += [-1, (num_blocks + 1) * block_size]
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    want = cache.clone()
    for t, slot in enumerate(slots):
        if 0 <= slot < (num_blocks + 1) * block_size:
            want[0, slot // block_size, :, slot % block_size] = k[t]
            want[1, slot // block_size, :, slot % block_size] = v[t]
    kernels.write_kv(k, v, cache, slot_mapping)
    assert same_bits(cache, want)


@pytest.mark.parametrize("dtype", [F16, BF16, F32])
def test_copy_blocks_all_layers_one_launch(dtype):
    kv_cache = torch.randn((3, 2, 9, 2, 16, 64)).to(dtype).to(DEVICE)
    # on the CPU (moved by the wrapper); the last two pairs name blocks outside the cache: skipped
    src_dst = torch.tensor([[1, 5], [2, 7], [8, 0], [3, 9], [-1, 4]], dtype=torch.int64)
    want = kv_cache.clone()
    want[:, :, src_dst[:3, 1]] = want[:, :, src_dst[:3, 0]]
    kernels.copy_blocks(kv_cache, src_dst)
    assert same_bits(kv_cache, want)
    kernels.CudaAttentionBackend().copy_blocks(kv_cache, torch.empty((0, 2), dtype=torch.int64))
    assert same_bits(kv_cache, want)


def test_copy_blocks_refuses_strided_caches_and_racing_pairs():
    """Host-side checks (issue 44): every layer plane is addressed from one base, and the pairs'
    CTAs run in any order."""
    big = torch.randn((6, 2, 9, 2, 16, 64)).to(F16).to(DEVICE)
    before = big.clone()
    with pytest.raises(ValueError, match="must be contiguous"):
        kernels.copy_blocks(big[::2], torch.tensor([[1, 5]]))
    with pytest.raises(ValueError, match="block 5 is the destination of two copies"):
        kernels.copy_blocks(big, torch.tensor([[1, 5], [2, 5]]))
    with pytest.raises(ValueError, match="block 5 is both a destination and a source"):
        kernels.copy_blocks(big, torch.tensor([[1, 5], [5, 7]], device=DEVICE))
    torch.cuda.synchronize()
    assert same_bits(big, before)


# ---- the backend ---------------------------------------------------------------------------------------

FORWARD_CASES = [
    # dtype, head_dim, block_size, num_kv_heads, queries_per_kv, specs
    (BF16, 128, 16, 4, 4, [(30, 1), (1800, 1), (9, 1), (40, 17), (20, 20), (300, 100)]),
    (F16, 64, 32, 2, 1, [(5, 1), (70, 30), (33, 33)]),
    (F32, 128, 16, 1, 8, [(1, 1), (1200, 1), (100, 1)]),
]


def _forward_inputs(dtype, head_dim, block_size, num_kv_heads, queries_per_kv, specs, seed=0):
    return forward_inputs(dtype, head_dim, block_size, num_kv_heads, queries_per_kv, specs, seed, device=DEVICE)


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


WINDOW_CASES = [
    # kind, dtype, head_dim, block_size, num_kv_heads, queries_per_kv, window, softcap, specs
    ("decode", BF16, 256, 16, 1, 2, 70, 50.0, [(20, 1), (200, 1), (1500, 1)]),
    ("decode-split", BF16, 128, 16, 2, 8, 600, None, [(90, 1), (1100, 1), (2000, 1)]),
    ("simt", BF16, 256, 16, 1, 2, 48, 50.0, [(40, 40), (300, 70), (120, 1)]),
    ("mma", F16, 128, 16, 2, 4, 33, None, [(150, 150), (400, 90), (64, 1)]),
    ("mma", BF16, 64, 32, 1, 7, 512, 30.0, [(900, 300), (70, 70)]),
]


@pytest.mark.parametrize("case", WINDOW_CASES, ids=lambda c: f"{c[0]}-{str(c[1])[6:]}-d{c[2]}-w{c[6]}-cap{c[7]}")
def test_window_and_softcap(case):
    """Sliding windows and soft-capped scores (issue 15) on the device, against the reference."""
    kind, dtype, head_dim, block_size, num_kv_heads, qpk, window, softcap, specs = case
    b = make_batch(dtype, head_dim, block_size, num_kv_heads, qpk, specs)
    scale = 1 / math.sqrt(head_dim)
    if kind.startswith("decode"):
        out = kernels.paged_decode_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"], scale,
                                             b["max_seq_len"], split_k=kind == "decode-split", window=window,
                                             softcap=softcap)
    else:
        out = kernels.paged_prefill_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"],
                                              b["query_start_loc"], scale, b["max_query_len"], impl=kind,
                                              window=window, softcap=softcap)
    torch.cuda.synchronize()
    want = reference_attention(b["q"], b["cache"].nan_to_num(), b["block_tables"], b["seq_lens"],
                               b["query_start_loc"], scale, window=window, softcap=softcap)
    got = out.double().cpu()
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])
