"""The CUDA kernels, run on the CPU through the SIMT emulator (tests/kernel_emu), against the float64
reference that walks the block table token by token (tests/kernel_reference.py).

This is the same source the GPU compiles (minus the PTX branches: mma.sync and ldmatrix run as their
shuffle-based equivalents in common.cuh) behind the real Python wrappers, so it checks indexing
(block tables, slot mapping, the dummy block, causal offsets, split-K partitions and their
reduction, GQA head chunks, padding rows), synchronization (every barrier reached by every
thread; cp.async data and shared memory read only after they are written) and alignment, on
every dtype, head_dim 32-256, block sizes 8-64 and ragged contexts. What it cannot show: speed,
races between threads, and the PTX instructions themselves (tests/gpu covers those on a device).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from kernel_emu import EmulatorError, KernelEmulator, emulated, find_compiler
from kernel_reference import forward_inputs, make_batch, reference_attention

pytestmark = pytest.mark.skipif(find_compiler() is None, reason="no C++ compiler for the kernel emulator")

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
TOL = {F16: 5e-3, BF16: 3e-2, F32: 1e-4}

DECODE_CASES = [
    # dtype, head_dim, block_size, num_kv_heads, queries_per_kv, split_k, context lengths
    (F16, 128, 16, 2, 4, False, [1, 16, 17, 300, 1500]),
    (BF16, 128, 32, 2, 8, True, [1, 511, 512, 513, 1025]),  # partition boundaries
    (F32, 128, 16, 1, 4, True, [3, 1024, 1030]),
    (BF16, 64, 16, 4, 1, False, [2, 33, 700]),
    (F16, 64, 32, 1, 8, True, [64, 1100]),
    (F32, 64, 16, 2, 1, None, [7, 1030]),  # few CTAs, long context: split-K picked
    (BF16, 128, 16, 1, 12, False, [9, 200]),  # GQA group in 2 chunks of 6 heads
    (F16, 128, 16, 1, 11, True, [40, 600]),  # 11 heads: a chunk of 8 and a partial chunk of 3
    (BF16, 64, 8, 2, 7, True, [9, 520]),
    (F16, 64, 64, 1, 5, False, [65, 130]),
    (BF16, 256, 16, 1, 2, True, [50, 530]),
    (F32, 32, 16, 1, 3, False, [1, 40]),
    # head_dim 80 / 96 (Phi-3, ...): V dims on 20 / 24 lanes, the rest idle
    (F16, 80, 16, 2, 4, False, [1, 33, 300]),
    (BF16, 80, 16, 1, 8, True, [70, 1030]),
    (BF16, 96, 16, 2, 3, False, [5, 129]),
    (F32, 96, 32, 1, 4, True, [17, 600]),
]

PREFILL_CASES = [
    # dtype, head_dim, block_size, num_kv_heads, queries_per_kv, impl, [(seq_len, query_len)]
    # fresh prompts, chunks after a cached prefix, a lone last token, several q and kv tiles
    (F16, 128, 16, 2, 4, "mma", [(37, 37), (150, 45), (300, 1), (100, 70)]),
    (BF16, 128, 32, 1, 4, "mma", [(130, 70), (5, 5)]),
    (F16, 64, 16, 2, 1, "mma", [(200, 150), (64, 64)]),
    (BF16, 64, 32, 1, 7, "mma", [(90, 50), (3, 3), (66, 1)]),  # 7 heads x 9 tokens: a padding row
    (F16, 32, 8, 1, 80, "mma", [(20, 3), (6, 6)]),  # 80 heads per kv head: 2 head chunks, 1 token each
    (F16, 128, 16, 2, 4, "simt", [(37, 37), (300, 45), (600, 1), (200, 130)]),
    (BF16, 64, 16, 1, 8, "simt", [(80, 13), (64, 64)]),
    (F32, 128, 16, 2, 2, "simt", [(50, 20), (9, 9)]),  # 512-byte rows: 32-row tiles
    (F32, 64, 32, 1, 1, "simt", [(100, 100), (33, 1)]),
    (F16, 128, 32, 1, 12, "simt", [(60, 25), (17, 17)]),
    (BF16, 256, 16, 1, 2, "simt", [(40, 40), (70, 33)]),
    (F32, 32, 16, 1, 80, "simt", [(20, 3), (6, 6)]),
    # head_dim 80 / 96: five / six k16 blocks on tensor cores; SIMT 4-byte columns for fp16 80
    (F16, 80, 16, 2, 4, "mma", [(37, 37), (150, 45), (70, 1)]),
    (BF16, 96, 16, 1, 3, "mma", [(100, 70), (9, 9)]),
    (F16, 80, 16, 2, 2, "simt", [(60, 40), (33, 1)]),
    (BF16, 96, 16, 1, 4, "simt", [(50, 50), (80, 17)]),
    (F32, 80, 16, 1, 2, "simt", [(45, 30), (5, 5)]),
    (F32, 96, 16, 2, 1, "simt", [(40, 40)]),
]


@pytest.fixture(scope="module")
def emulator() -> KernelEmulator:
    """One build with every instantiation the tests below need (learnt by a recording pass)."""
    names: set[str] = set()
    with emulated(None, record=names):
        for case in DECODE_CASES:
            _decode(case)
        for case in PREFILL_CASES:
            _prefill(case)
        for dtype in (F16, BF16, F32):
            _write_and_copy(dtype)
        _mixed_forward(BF16)
        _mixed_forward(F32)
        _decode((F32, 64, 16, 2, 2, False, [5]))  # the tiny engine models below
        _decode((F32, 96, 16, 2, 2, False, [5]))
        _prefill((F32, 96, 16, 2, 2, "simt", [(5, 5)]))
        _decode((BF16, 128, 32, 2, 8, False, [5]))  # the empty-context test
        _decode((F32, 64, 16, 2, 2, True, [5]))  # the graph-bucket test
        for dtype in (BF16, F32):
            _per_token(dtype, *_INVARIANT_LAYOUT, [(0, 1)], [(2, (9, 1))])
        _prefill((F32, 64, 16, 2, 2, "simt", [(5, 5)]))
        for case in WINDOW_CASES:
            _windowed(case)
    return KernelEmulator.for_names(names)


def _decode(case, seed=0):
    dtype, head_dim, block_size, num_kv_heads, queries_per_kv, split_k, lens = case
    from prefixkv.attention import cuda as kernels

    b = make_batch(dtype, head_dim, block_size, num_kv_heads, queries_per_kv, [(L, 1) for L in lens], seed)
    scale = 1 / math.sqrt(head_dim)
    out = kernels.paged_decode_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"], scale,
                                         b["max_seq_len"], split_k=split_k)
    return b, out, scale


def _prefill(case, seed=0):
    dtype, head_dim, block_size, num_kv_heads, queries_per_kv, impl, specs = case
    from prefixkv.attention import cuda as kernels

    b = make_batch(dtype, head_dim, block_size, num_kv_heads, queries_per_kv, specs, seed)
    scale = 1 / math.sqrt(head_dim)
    out = kernels.paged_prefill_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"],
                                          b["query_start_loc"], scale, b["max_query_len"], impl=impl)
    return b, out, scale


def _assert_close(got, want, dtype):
    got = got.detach().double()
    assert not got.isnan().any(), "NaN in the kernel output (a read of unwritten or out-of-context memory)"
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"{str(c[0])[6:]}-d{c[1]}-bs{c[2]}-kv{c[3]}x{c[4]}-split{c[5]}")
def test_decode_matches_reference(emulator, case):
    with emulated(emulator, num_sms=132):
        b, out, scale = _decode(case)
    want = reference_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"], b["query_start_loc"], scale)
    _assert_close(out, want, case[0])


@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: f"{c[5]}-{str(c[0])[6:]}-d{c[1]}-bs{c[2]}-kv{c[3]}x{c[4]}")
def test_prefill_matches_reference(emulator, case):
    with emulated(emulator):
        b, out, scale = _prefill(case)
    want = reference_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"], b["query_start_loc"], scale)
    _assert_close(out, want, case[0])


@pytest.mark.parametrize("split_k", [False, True])
def test_decode_empty_context_rows_are_zero(emulator, split_k):
    """A row with seq_len 0 (nothing to attend to) comes out as zeros, not NaN, and its
    neighbours are unaffected."""
    from prefixkv.attention import cuda as kernels

    case = (BF16, 128, 32, 2, 8, split_k, [5, 600, 1])
    b = make_batch(*case[:5], [(L, 1) for L in case[6]])
    b["seq_lens"][1] = 0
    with emulated(emulator):
        out = kernels.paged_decode_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"], 0.1, 600,
                                             split_k=split_k)
    want = reference_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"], b["query_start_loc"], 0.1)
    assert (out[1] == 0).all()
    _assert_close(out, want, BF16)


def test_decode_split_k_grid_sized_by_an_upper_bound(emulator):
    """Split-K with the grid sized for max_model_len (as in a captured CUDA graph): partitions past
    a sequence's end exit, and the reduction only reads the partitions that were written."""
    from prefixkv.attention import cuda as kernels

    b = make_batch(BF16, 128, 32, 2, 8, [(L, 1) for L in (3, 513, 1025)])
    with emulated(emulator):
        out = kernels.paged_decode_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"], 0.1, 4096,
                                             split_k=True)
    want = reference_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"], b["query_start_loc"], 0.1)
    _assert_close(out, want, BF16)


def test_decode_split_k_row_longer_than_its_grid_is_nan_and_refused(emulator):
    """max_seq_len below a sequence's length (a caller's error): under split-K the grid misses that
    row's tail, so the row comes out NaN (not the attention of its first partitions) and its
    neighbours are right; the backend, which has the lengths on the host, refuses the metadata
    before any kernel runs (the cache untouched), as the batch-invariant path does."""
    from prefixkv.attention import cuda as kernels

    lens = (5, 1500, 600)
    b = make_batch(BF16, 128, 32, 2, 8, [(L, 1) for L in lens])
    with emulated(emulator):
        out = kernels.paged_decode_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"], 0.1, 1024,
                                             split_k=True)
    want = reference_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"], b["query_start_loc"], 0.1)
    assert out[1].isnan().all()
    _assert_close(out[[0, 2]], want[[0, 2]], BF16)

    b, q, k, v, meta, _ = forward_inputs(BF16, 128, 32, 2, 8, [(L, 1) for L in lens])
    meta.seq_lens_cpu, meta.query_start_loc_cpu, meta.max_seq_len = list(lens), [0, 1, 2, 3], 1024
    cache = b["cache"].clone()
    for backend in (kernels.CudaAttentionBackend(split_k=True), kernels.CudaAttentionBackend(batch_invariant=True)):
        with emulated(emulator), pytest.raises(ValueError, match="^max_seq_len: 1024 is below sequence 1's length"):
            backend.forward(q, k, v, b["cache"], meta, 0.1)
        assert torch.equal(b["cache"].view(torch.uint8), cache.view(torch.uint8))
        meta.scratch.clear()
    meta.max_seq_len, meta.max_query_len, meta.query_start_loc_cpu = 1500, 1, [0, 1, 3, 3]
    with emulated(emulator), pytest.raises(ValueError, match="^max_query_len: 1 is below a sequence's 2 query"):
        kernels.CudaAttentionBackend().forward(q, k, v, b["cache"], meta, 0.1)


def _eager_and_bucket(emulator, n, num_sms=6, kv_heads=2, qpk=2, head_dim=64, block_size=16, max_model_len=2048,
                      seed=0):
    """Attention of n decode rows eagerly and replayed through CudaGraphRunner's static inputs
    padded to n's bucket (a stand-in graph runs the backend on them, as the captured one would):
    (eager output, the bucket's output for those rows, kernels launched eagerly, in the bucket)."""
    from prefixkv.attention import AttentionMetadata, kv_cache_shape
    from prefixkv.attention.cuda import CudaAttentionBackend
    from prefixkv.runner.cuda_graph import CudaGraphRunner

    gen = torch.Generator().manual_seed(seed)
    width = -(-max_model_len // block_size)
    kv_cache = torch.randn(kv_cache_shape(1, 8 * width, kv_heads, block_size, head_dim), generator=gen)
    runner = CudaGraphRunner(model=None, backend=CudaAttentionBackend(), kv_cache=kv_cache, max_num_seqs=8,
                             max_model_len=max_model_len, block_size=block_size)
    b = runner.bucket_for(n)
    qkv = torch.randn((b, kv_heads * (qpk + 2), head_dim), generator=gen)
    lens = [int(x) for x in torch.randint(1, max_model_len, (n,), generator=gen)]
    tables = torch.arange(n * width, dtype=torch.int32).view(n, width)
    slots = torch.tensor([int(tables[i, (L - 1) // block_size]) * block_size + (L - 1) % block_size
                          for i, L in enumerate(lens)])
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=torch.arange(n + 1, dtype=torch.int32),
                             seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables, num_decode_seqs=n,
                             max_seq_len=max_model_len, max_query_len=1, seq_lens_cpu=lens,
                             query_start_loc_cpu=list(range(n + 1)))
    h = kv_heads * qpk

    def forward(rows, m):
        return runner.backend.forward(qkv[:rows, :h], qkv[:rows, h:h + kv_heads], qkv[:rows, h + kv_heads:],
                                      runner.kv_cache[0], m, 0.125)

    class Graph:
        def replay(self):
            self.out = forward(b, runner._meta(b))

    runner.graphs[b], runner.outputs[b] = Graph(), torch.zeros(b, 1)
    launched = {"eager": set(), "bucket": set()}
    with emulated(emulator, num_sms=num_sms, record=launched["eager"]):
        eager = forward(n, meta)
    with emulated(emulator, num_sms=num_sms, record=launched["bucket"]):
        runner.replay(torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64), meta)
    return eager, runner.graphs[b].out[:n], launched["eager"], launched["bucket"]


def test_decode_rows_same_bits_eagerly_and_in_a_graph_bucket(emulator):
    """5 decodes, 2 KV heads, GQA 2 on 6 SMs: eagerly 10 CTAs (< 2 waves: split-K by the old rule),
    in bucket 8 16 CTAs (no split). Now both run the same kernels, and the rows come out bitwise
    equal, as tests/gpu/test_decode_paths.py checks against captured graphs on a device."""
    eager, replayed, launched_eager, launched_bucket = _eager_and_bucket(emulator, 5)
    assert launched_eager == launched_bucket
    assert torch.equal(eager.view(torch.uint8), replayed.view(torch.uint8))


def test_prefill_first_seq_and_empty_query_chunks(emulator):
    """Only sequences from first_seq on are computed (the rows before are left alone), and a
    sequence with no query token this step launches nothing that writes."""
    from prefixkv.attention import cuda as kernels

    case = (F16, 128, 16, 2, 4, "mma", [(10, 1), (20, 1), (50, 30), (40, 0), (37, 37)])
    dtype, head_dim, block_size, num_kv_heads, qpk, impl, specs = case
    b = make_batch(dtype, head_dim, block_size, num_kv_heads, qpk, specs)
    out = torch.full_like(b["q"], 7.0)
    with emulated(emulator):
        kernels.paged_prefill_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"], b["query_start_loc"],
                                        0.125, b["max_query_len"], first_seq=2, out=out, impl=impl)
    want = reference_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"], b["query_start_loc"], 0.125,
                               first_seq=2)
    assert (out[:2] == 7.0).all()
    _assert_close(out[2:], want[2:], dtype)


def _write_and_copy(dtype, block_size=16):
    from prefixkv.attention import cuda as kernels

    num_blocks, num_kv_heads, head_dim, num_tokens = 6, 2, 64, 9
    cache = torch.randn((2, num_blocks + 1, num_kv_heads, block_size, head_dim)).to(dtype)
    fused = torch.randn((num_tokens, 3, num_kv_heads, head_dim)).to(dtype)  # k, v: strided views
    k, v = fused[:, 0], fused[:, 2]
    dummy = num_blocks * block_size  # first slot of the dummy block
    slots = random.Random(block_size).sample(range(num_blocks * block_size), num_tokens - 3)
    slots += [dummy + 3, -1, (num_blocks + 1) * block_size]  # the dummy block, skipped, past the cache
    want = cache.clone()
    for t, slot in enumerate(slots[:-2]):
        want[0, slot // block_size, :, slot % block_size] = k[t]
        want[1, slot // block_size, :, slot % block_size] = v[t]
    kernels.write_kv(k, v, cache, torch.tensor(slots, dtype=torch.int64))
    kv_cache = torch.randn((3, 2, 9, 2, 16, 64)).to(dtype)
    pairs = torch.tensor([[1, 5], [2, 7], [8, 0], [3, 9], [-1, 4]], dtype=torch.int64)  # last two: skipped
    want_kv = kv_cache.clone()
    want_kv[:, :, pairs[:3, 1]] = want_kv[:, :, pairs[:3, 0]]
    kernels.copy_blocks(kv_cache, pairs)
    return cache, want, kv_cache, want_kv


@pytest.mark.parametrize("dtype", [F16, BF16, F32])
def test_write_kv_and_copy_blocks_are_exact(emulator, dtype):
    with emulated(emulator):
        cache, want, kv_cache, want_kv = _write_and_copy(dtype)
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(kv_cache.view(torch.uint8), want_kv.view(torch.uint8))


def test_copy_blocks_refuses_what_would_corrupt_or_race(emulator):
    """copy_blocks addresses every layer plane from one base: a view whose layer 0 is contiguous but
    whose layers are not (every other layer of a larger cache) is refused, not written into the
    wrong layers. Its pairs run in parallel CTAs: a block that is the destination of two pairs, or
    both a destination and a source, is refused on the host; pairs skipped as out of range do not
    count."""
    from prefixkv.attention import cuda as kernels

    big = torch.randn((6, 2, 9, 2, 16, 64)).to(F16)
    before = big.clone()
    every_other = big[::2]
    assert every_other[0].is_contiguous() and not every_other.is_contiguous()
    with emulated(emulator), pytest.raises(ValueError, match=r"^kv_cache: must be contiguous"):
        kernels.copy_blocks(every_other, torch.tensor([[1, 5]]))
    assert torch.equal(big.view(torch.uint8), before.view(torch.uint8))

    kv_cache = torch.randn((3, 2, 9, 2, 16, 64)).to(F16)
    want = kv_cache.clone()
    for pairs, error in (([[1, 5], [2, 5]], "block 5 is the destination of two copies"),
                         ([[1, 5], [5, 7]], "block 5 is both a destination and a source"),
                         ([[1, 5], [3, 1]], "block 1 is both a destination and a source"),
                         ([[4, 4]], "block 4 is both a destination and a source")):
        with emulated(emulator), pytest.raises(ValueError, match=f"^src_dst: {error}"):
            kernels.copy_blocks(kv_cache, torch.tensor(pairs))
    assert torch.equal(kv_cache.view(torch.uint8), want.view(torch.uint8))
    with emulated(emulator):  # the second pair names block 9, past the cache: skipped, no conflict
        kernels.copy_blocks(kv_cache, torch.tensor([[1, 5], [9, 5], [5, 9]]))
    want[:, :, 5] = want[:, :, 1]
    assert torch.equal(kv_cache.view(torch.uint8), want.view(torch.uint8))


def _mixed_forward(dtype):
    from prefixkv.attention import cuda as kernels

    specs = [(30, 1), (1100, 1), (9, 1), (40, 17), (20, 20), (90, 33)]
    b, q, k, v, meta, want_cache = forward_inputs(dtype, 64, 16, 2, 4, specs)
    out = kernels.CudaAttentionBackend().forward(q, k, v, b["cache"], meta, 0.125)
    return b, q, out, want_cache


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_backend_forward_mixed_batch(emulator, dtype):
    """Decodes and prefill chunks in one batch, q/k/v strided views of a fused projection: the
    backend writes exactly the slots of slot_mapping, then attends (decode + prefill kernels)."""
    with emulated(emulator):
        b, q, out, want_cache = _mixed_forward(dtype)
    assert torch.equal(b["cache"].view(torch.uint8), want_cache.view(torch.uint8))
    want = reference_attention(q, want_cache, b["block_tables"], b["seq_lens"], b["query_start_loc"], 0.125)
    _assert_close(out, want, dtype)


@pytest.mark.parametrize("arch,head_dim", [("llama", 64), ("gemma3", 64), ("phi3", 96)])
def test_engine_with_the_cuda_backend_equals_transformers(emulator, tmp_path, arch, head_dim):
    """The whole engine (chunked prefill, shared prefixes, n=2 forks with copy-on-write) with
    attention_backend="cuda" running the emulated kernels: greedy tokens equal transformers'
    (float32), as tests/gpu/test_engine_gpu.py checks on a device. Gemma 3's shape: KV cache
    groups, window 4 on two of three layers, its blocks before the window freed (kv/groups.py).
    Phi-3's: head_dim 96 (refused at the first step before the kernels took it)."""
    from transformers import AutoModelForCausalLM

    from prefixkv import LLM, SamplingParams
    from tiny_models import build_model, build_tokenizer

    build_model(tmp_path, arch, build_tokenizer(tmp_path), head_dim=head_dim)
    rng = random.Random(0)
    shared = [rng.randrange(3, 384) for _ in range(40)]
    prompts = [(shared if i % 2 else []) + [rng.randrange(3, 384) for _ in range(rng.randrange(1, 70))]
               for i in range(6)]
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    refs = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=10,
                        do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    launches = emulator.num_launches
    with emulated(emulator):
        llm = LLM(model=str(tmp_path), device="cpu", dtype="float32", attention_backend="cuda", block_size=16,
                  max_num_batched_tokens=48, num_kv_blocks=64)
        outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
        forks = llm.generate(prompts[1:3], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, n=2))
    assert emulator.num_launches > launches
    assert llm.engine.runner.kv_plan.num_groups == (3 if arch == "gemma3" else 1)
    assert [o.token_ids for o in outs] == refs
    assert [[c.token_ids for c in o.outputs] for o in forks] == [[r[:6], r[:6]] for r in refs[1:3]]
    assert llm.engine.scheduler.kv.num_used_blocks == 0


# ---- the emulator catches what a GPU would ------------------------------------------------------


def _mutated_sources(file_name: str, old: str, new: str) -> dict[str, str]:
    from kernel_emu import _sources

    sources = _sources()
    assert sources[file_name].count(old) >= 1, f"{old!r} not in {file_name}"
    sources[file_name] = sources[file_name].replace(old, new, 1)
    return sources


@pytest.mark.parametrize("file_name,old,new,expect", [
    # the prefill SIMT kernel reading K before its cp.async group has landed
    ("paged_prefill.cu", "cp_async_wait<1>();  // Q and K(it) have landed", "// (no wait)", "NaN"),
    # the decode kernel merging the warps' partial results without the barrier
    ("paged_decode.cu", "  __syncthreads();\n\n  for (int i = tid; i < num_active * HEAD_DIM", "\n  for (int i = tid; "
     "i < num_active * HEAD_DIM", "NaN"),
    # a shuffle inside a branch only some lanes take
    ("paged_decode.cu", "const float m_new = fmaxf(m[g], warp_max<WARP_SIZE>(s));",
     "const float m_new = fmaxf(m[g], lane < 16 ? warp_max<WARP_SIZE>(s) : s);", "divergent|deadlock|left waiting"),
])
def test_emulator_catches_synchronization_bugs(file_name, old, new, expect):
    """Each mutation is a classic kernel bug; the emulator must flag it (not pass by luck)."""
    import re

    from kernel_emu import build_from_sources

    case = (F16, 64, 16, 2, 2, "simt", [(80, 40)]) if "prefill" in file_name else \
        (F16, 64, 16, 2, 2, False, [40, 70])
    names: set[str] = set()
    run = _prefill if "prefill" in file_name else _decode
    with emulated(None, record=names):
        run(case)
    emu = KernelEmulator(build_from_sources(_mutated_sources(file_name, old, new), names))
    try:
        with emulated(emu):
            b, out, scale = run(case)
    except EmulatorError as e:
        assert re.search(expect, str(e)), str(e)
        return
    assert expect == "NaN" and out.isnan().any(), "the mutated kernel passed unnoticed"


# ---- batch-invariant attention (issue 14) -------------------------------------------------------
_INVARIANT_LAYOUT = (64, 16, 1, 3)  # head_dim, block_size, num_kv_heads, queries_per_kv
_INVARIANT_CONTEXTS = [45, 530, 9]  # the middle one spans two 512-token split-K partitions


def _per_token(dtype, head_dim, block_size, num_kv_heads, queries_per_kv, rows, chunks, max_seq_len=None, seed=0):
    """Invariant attention of query positions of three fixed contexts (one cache, one q per
    position): ``rows`` [(seq, position)] run as decode rows, then ``chunks`` [(seq, (end, n))]
    as prefill chunks of the query tokens end - n .. end - 1, all in one batch. Returns
    ({(seq, position): output [H, D]}, the batch holding the contexts)."""
    from prefixkv.attention import cuda as kernels
    from prefixkv.attention.base import AttentionMetadata

    full = make_batch(dtype, head_dim, block_size, num_kv_heads, queries_per_kv,
                      [(L, L) for L in _INVARIANT_CONTEXTS], seed)
    starts = full["query_start_loc"].tolist()
    q_of = lambda s, p: full["q"][starts[s] + p]  # noqa: E731  the query of position p of context s
    specs = [(p + 1, 1, s) for s, p in rows] + [(end, n, s) for s, (end, n) in chunks]
    q = torch.stack([q_of(s, p) for L, n, s in specs for p in range(L - n, L)])
    qsl = [0]
    for _, n, _ in specs:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(q), dtype=torch.int64), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor([L for L, _, _ in specs], dtype=torch.int32),
        block_tables=full["block_tables"][[s for _, _, s in specs]].contiguous(), num_decode_seqs=len(rows),
        max_seq_len=max_seq_len or max(L for L, _, _ in specs), max_query_len=max(n for _, n, _ in specs),
        query_start_loc_cpu=qsl)
    out = kernels.paged_attention_per_token(q, full["cache"], meta, 1 / math.sqrt(head_dim))
    got = {}
    t = 0
    for L, n, s in specs:
        for p in range(L - n, L):
            got[(s, p)] = out[t]
            t += 1
    return got, full


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_invariant_attention_is_bitwise_the_same_in_any_batch_chunking_and_grid(emulator, dtype):
    """CudaAttentionBackend(batch_invariant=True): a query position's output is bitwise equal
    whether it runs as a decode row, inside a whole prompt, inside a chunk of another size, in a
    batch with other sequences or alone, and with the split-K grid sized for 4096 tokens; and
    close to the float64 reference."""
    layout = _INVARIANT_LAYOUT
    probes = [(0, 44), (0, 20), (1, 529), (1, 511), (1, 512), (1, 500), (2, 8), (2, 0)]
    with emulated(emulator, num_sms=132):  # an H100's count: the automatic split-K choice would differ here
        # 1. everything as prefill chunks in one batch (seq 1 only from position 490)
        batch, full = _per_token(dtype, *layout, [], [(0, (45, 45)), (1, (530, 40)), (2, (9, 9))])
        # 2. decode rows of the probes, all in one batch
        decodes, _ = _per_token(dtype, *layout, probes, [])
        # 3. each sequence alone, in other chunks; seq 1's grid sized for 4096 tokens
        alone = {}
        for s, pieces in ((0, [(21, 21), (45, 24)]), (1, [(513, 23), (530, 17)]), (2, [(1, 1), (9, 8)])):
            for end, n in pieces:
                got, _ = _per_token(dtype, *layout, [], [(s, (end, n))], max_seq_len=4096 if s == 1 else None)
                alone.update(got)
    for key in probes:
        assert torch.equal(batch[key].view(torch.uint8), decodes[key].view(torch.uint8)), key
        assert torch.equal(batch[key].view(torch.uint8), alone[key].view(torch.uint8)), key
    # and right: against the float64 reference for every position of the one-batch run
    starts = full["query_start_loc"].tolist()
    want = reference_attention(full["q"], full["cache"], full["block_tables"], full["seq_lens"],
                               full["query_start_loc"], 1 / math.sqrt(layout[0]))
    for (s, p), o in batch.items():
        torch.testing.assert_close(o.double(), want[starts[s] + p], atol=TOL[dtype], rtol=TOL[dtype])



# ---- sliding windows and soft-capping (issue 15: Mistral, Gemma 2 / 3, Qwen windowed layers) ----
WINDOW_CASES = [
    # kind, dtype, head_dim, block_size, num_kv_heads, queries_per_kv, window, softcap, [(seq_len, query_len)]
    ("decode", BF16, 128, 16, 2, 4, 40, None, [(1, 1), (39, 1), (40, 1), (41, 1), (300, 1)]),
    ("decode-split", BF16, 128, 16, 1, 8, 100, None, [(90, 1), (600, 1), (1100, 1), (1025, 1)]),  # partitions
    ("decode-split", F32, 64, 32, 2, 2, 1, None, [(5, 1), (700, 1)]),  # a window of one token: itself
    ("decode", F16, 256, 16, 1, 2, 70, 50.0, [(20, 1), (200, 1)]),  # Gemma 2's shape
    ("decode", F32, 64, 16, 2, 2, None, 1.5, [(9, 1), (130, 1)]),  # capping alone, a strong one
    ("simt", BF16, 256, 16, 1, 2, 48, 50.0, [(40, 40), (300, 70), (120, 1)]),  # Gemma: head_dim 256
    ("simt", F32, 64, 16, 2, 4, 17, None, [(100, 100), (260, 33)]),
    ("mma", F16, 128, 16, 2, 4, 33, None, [(150, 150), (400, 90), (64, 1)]),
    ("mma", BF16, 64, 32, 1, 7, 64, 30.0, [(200, 65), (70, 70)]),
    ("per-token", BF16, 64, 16, 1, 3, 25, 20.0, [(45, 45), (530, 40), (9, 9)]),
]


def _windowed(case, seed=0):
    """One launch with a window / soft-cap; the blocks wholly before every query's window hold NaN
    (a kernel that reads one, even to multiply it by zero, shows it)."""
    from prefixkv.attention import cuda as kernels
    from prefixkv.attention.base import AttentionMetadata

    kind, dtype, head_dim, block_size, num_kv_heads, qpk, window, softcap, specs = case
    b = make_batch(dtype, head_dim, block_size, num_kv_heads, qpk, specs, seed)
    if window is not None:
        for s, (seq_len, query_len) in enumerate(specs):
            first_seen = max(0, seq_len - query_len - window + 1)
            for j in range(first_seen // block_size):
                b["cache"][:, b["block_tables"][s, j]] = float("nan")
    scale = 1 / math.sqrt(head_dim)
    if kind.startswith("decode"):
        out = kernels.paged_decode_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"], scale,
                                             b["max_seq_len"], split_k=kind == "decode-split", window=window,
                                             softcap=softcap)
    elif kind == "per-token":
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(len(b["q"]), dtype=torch.int64), query_start_loc=b["query_start_loc"],
            seq_lens=b["seq_lens"], block_tables=b["block_tables"], num_decode_seqs=0,
            max_seq_len=b["max_seq_len"], max_query_len=b["max_query_len"],
            query_start_loc_cpu=b["query_start_loc"].tolist())
        out = kernels.paged_attention_per_token(b["q"], b["cache"], meta, scale, window=window, softcap=softcap)
    else:
        out = kernels.paged_prefill_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"],
                                              b["query_start_loc"], scale, b["max_query_len"], impl=kind,
                                              window=window, softcap=softcap)
    return b, out, scale


@pytest.mark.parametrize("case", WINDOW_CASES, ids=lambda c: f"{c[0]}-{str(c[1])[6:]}-d{c[2]}-w{c[6]}-cap{c[7]}")
def test_window_and_softcap_match_reference(emulator, case):
    with emulated(emulator, num_sms=132):
        b, out, scale = _windowed(case)
    window, softcap = case[6], case[7]
    want = reference_attention(b["q"], b["cache"].nan_to_num(), b["block_tables"], b["seq_lens"],
                               b["query_start_loc"], scale, window=window, softcap=softcap)
    _assert_close(out, want, case[1])
    plain = reference_attention(b["q"], b["cache"].nan_to_num(), b["block_tables"], b["seq_lens"],
                                b["query_start_loc"], scale)
    assert not torch.allclose(out.double(), plain, atol=TOL[case[1]], rtol=TOL[case[1]])  # the option is real


def test_window_and_softcap_arguments_are_checked():
    from prefixkv.attention import cuda as kernels

    with pytest.raises(ValueError, match=r"^window: must be >= 1, got 0"):
        kernels._window_softcap(0, None)
    with pytest.raises(ValueError, match=r"^softcap: must be > 0, got -1.0"):
        kernels._window_softcap(None, -1.0)
    assert kernels._window_softcap(None, None) == (0, 0.0)
