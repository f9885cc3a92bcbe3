"""The CUDA decode path's choices on a device (issue 44; their CPU halves are in
tests/test_cuda_graph_buckets.py, tests/test_kernel_emulation.py and tests/test_cuda_config.py):

* the same decode rows give bitwise the same attention eagerly and replayed from the CUDA graph of
  the bucket they are padded to, for every batch size up to 64, with a KV-head count that puts this
  device's split-K edge inside a bucket (where the old rule split one and not the other);
* the engine with CUDA graphs and with --enforce-eager: the same tokens and bitwise the same
  logprobs, split-K in play (max_model_len 4096) and batches padded to buckets;
* a sequence longer than max_seq_len: NaN row under split-K, an error where the lengths are known;
* the split-K scratch the KV budget counts is what a decode layer allocates.
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

from prefixkv.attention import AttentionMetadata, kv_cache_shape  # noqa: E402
from prefixkv.attention import cuda as kernels  # noqa: E402
from prefixkv.runner.cuda_graph import decode_buckets  # noqa: E402

from kernel_reference import make_batch, reference_attention  # noqa: E402

DEVICE = torch.device("cuda")


def _num_sms() -> int:
    return torch.cuda.get_device_properties(DEVICE).multi_processor_count


def _kv_heads_at_an_old_edge(num_sms: int, max_num_seqs: int = 64) -> int:
    """A KV-head count (GQA group 1) for which counting the real batch's CTAs and counting its
    bucket's disagree for some batch size: this device's split-K edge inside a bucket."""
    buckets = decode_buckets(max_num_seqs)
    for kv_heads in range(1, 65):
        for n in range(1, max_num_seqs + 1):
            b = next(x for x in buckets if x >= n)
            if (n * kv_heads < 2 * num_sms) != (b * kv_heads < 2 * num_sms):
                return kv_heads
    raise AssertionError(f"no KV-head count puts the split-K edge of {num_sms} SMs inside a bucket")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_decode_bits_equal_eagerly_and_in_a_graph_bucket():
    """Every batch size 1-64, eager against the graph of its bucket (padding rows on the dummy
    block, as runner/cuda_graph.py pads): the same attention bits, split-K or not."""
    max_num_seqs, max_model_len, block_size, head_dim, dtype = 64, 4096, 16, 128, torch.bfloat16
    kv_heads = _kv_heads_at_an_old_edge(_num_sms(), max_num_seqs)
    buckets = decode_buckets(max_num_seqs)
    n_max = buckets[-1]
    blocks_per_seq = -(-1500 // block_size)
    num_blocks = n_max * blocks_per_seq
    dummy = num_blocks
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(kv_cache_shape(1, num_blocks, kv_heads, block_size, head_dim), device=DEVICE,
                        generator=torch.Generator(device=DEVICE).manual_seed(0)).to(dtype)[0].contiguous()
    lens = [random.Random(i).randint(1, 1500) for i in range(n_max)]
    tables = torch.arange(n_max * blocks_per_seq, dtype=torch.int32).view(n_max, blocks_per_seq)
    qkv = torch.randn((n_max, 3, kv_heads, head_dim), generator=gen).to(dtype).to(DEVICE)
    slots = torch.tensor([int(tables[i, (L - 1) // block_size]) * block_size + (L - 1) % block_size
                          for i, L in enumerate(lens)], dtype=torch.int64)
    backend = kernels.CudaAttentionBackend()

    # static inputs (rows past the batch: padding on the dummy block) and one graph per bucket
    s_q = torch.zeros((n_max, 3, kv_heads, head_dim), dtype=dtype, device=DEVICE)
    s_lens = torch.ones(n_max, dtype=torch.int32, device=DEVICE)
    s_tables = torch.full((n_max, blocks_per_seq), dummy, dtype=torch.int32, device=DEVICE)
    s_slots = torch.full((n_max,), dummy * block_size, dtype=torch.int64, device=DEVICE)
    s_qsl = torch.arange(n_max + 1, dtype=torch.int32, device=DEVICE)

    def meta(b, lens_t, tables_t, slots_t, qsl_t):
        return AttentionMetadata(slot_mapping=slots_t[:b], query_start_loc=qsl_t[:b + 1], seq_lens=lens_t[:b],
                                 block_tables=tables_t[:b], num_decode_seqs=b, max_seq_len=max_model_len,
                                 max_query_len=1)

    def forward(b, q3, m):
        return backend.forward(q3[:b, 0], q3[:b, 1], q3[:b, 2], cache, m, 1 / math.sqrt(head_dim))

    graphs, outs = {}, {}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(buckets):
            forward(b, s_q, meta(b, s_lens, s_tables, s_slots, s_qsl))  # compiles outside the capture
            g = torch.cuda.CUDAGraph()
            m = meta(b, s_lens, s_tables, s_slots, s_qsl)
            with torch.cuda.graph(g, pool=pool, stream=stream):
                outs[b] = forward(b, s_q, m)
            graphs[b] = g
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()

    chosen = set()
    for n in range(1, max_num_seqs + 1):
        b = next(x for x in buckets if x >= n)
        s_q.zero_()
        s_q[:n].copy_(qkv[:n])
        s_lens.fill_(1)
        s_lens[:n].copy_(torch.tensor(lens[:n], dtype=torch.int32))
        s_tables.fill_(dummy)
        s_tables[:n].copy_(tables[:n])
        s_slots.fill_(dummy * block_size)
        s_slots[:n].copy_(slots[:n])
        graphs[b].replay()
        replayed = outs[b][:n].clone()
        m = AttentionMetadata(slot_mapping=slots[:n].to(DEVICE), query_start_loc=s_qsl[:n + 1].clone(),
                              seq_lens=torch.tensor(lens[:n], dtype=torch.int32, device=DEVICE),
                              block_tables=tables[:n].to(DEVICE), num_decode_seqs=n, max_seq_len=max_model_len,
                              max_query_len=1, seq_lens_cpu=lens[:n], query_start_loc_cpu=list(range(n + 1)))
        eager = forward(n, qkv, m)
        torch.cuda.synchronize()
        assert _same_bits(replayed, eager), f"{n} decodes (bucket {b}): graph and eager attention differ"
        chosen.add(kernels.decode_split_k(n, kv_heads, 1, max_model_len, _num_sms()))
    assert chosen == {False, True}, "the range should hold batches on both sides of the split-K edge"


def test_engine_graphs_and_eager_same_tokens_and_logprob_bits(tmp_path):
    """Greedy requests with logprobs through the engine, CUDA graphs against --enforce-eager
    (float32, TF32 off): max_model_len 4096 puts split-K in play, 25 and 9 requests run in padded
    buckets; tokens equal and every logprob bitwise equal."""
    from prefixkv import LLM, SamplingParams
    from tiny_models import build_model, build_tokenizer

    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        build_model(tmp_path, "llama", build_tokenizer(tmp_path), head_dim=64, max_position_embeddings=4096)
        rng = random.Random(7)
        prompts = [[rng.randrange(3, 384) for _ in range(rng.randrange(5, 90))] for _ in range(25)]
        sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
        runs = []
        for eager in (True, False):
            llm = LLM(model=str(tmp_path), device="cuda", dtype="float32", max_num_seqs=32, num_kv_blocks=512,
                      enforce_eager=eager)
            assert (llm.engine.runner.graphs is None) == eager
            runs.append([llm.generate(prompts, sp), llm.generate(prompts[:9], sp)])
            del llm
            torch.cuda.empty_cache()
        for outs_e, outs_g in zip(*runs):
            assert [o.token_ids for o in outs_g] == [o.token_ids for o in outs_e]
            for i, (o_g, o_e) in enumerate(zip(outs_g, outs_e)):  # floats compared with ==: bitwise
                lp_g = [(t.token_id, t.logprob, t.top_logprobs) for t in o_g.outputs[0].token_logprobs]
                lp_e = [(t.token_id, t.logprob, t.top_logprobs) for t in o_e.outputs[0].token_logprobs]
                worst = max(abs(a[1] - b[1]) for a, b in zip(lp_g, lp_e))
                assert lp_g == lp_e, (
                    f"request {i}: graph and eager logprobs differ (max |diff| {worst:.3g}); the attention alone "
                    "is checked bitwise by test_decode_bits_equal_eagerly_and_in_a_graph_bucket, so a difference "
                    "here comes from elsewhere (e.g. cuBLAS GEMMs choosing by the padded row count)")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def test_rows_longer_than_max_seq_len_are_nan_and_refused():
    lens = (5, 1500, 600)
    b = make_batch(torch.bfloat16, 128, 32, 2, 8, [(L, 1) for L in lens], device=DEVICE)
    out = kernels.paged_decode_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"], 0.1, 1024,
                                         split_k=True)
    torch.cuda.synchronize()
    assert out[1].isnan().all() and not out[[0, 2]].isnan().any()
    want = reference_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"], b["query_start_loc"], 0.1)
    torch.testing.assert_close(out[[0, 2]].double().cpu(), want[[0, 2]], atol=3e-2, rtol=3e-2)
    meta = AttentionMetadata(slot_mapping=torch.zeros(3, dtype=torch.int64, device=DEVICE),
                             query_start_loc=b["query_start_loc"], seq_lens=b["seq_lens"],
                             block_tables=b["block_tables"], num_decode_seqs=3, max_seq_len=1024, max_query_len=1,
                             seq_lens_cpu=list(lens), query_start_loc_cpu=[0, 1, 2, 3])
    kv = b["q"][:, :2]
    with pytest.raises(ValueError, match="max_seq_len: 1024 is below sequence 1's length 1500"):
        kernels.CudaAttentionBackend(split_k=True).forward(b["q"], kv, kv, b["cache"], meta, 0.1)


def test_split_k_scratch_is_what_the_budget_counts():
    """The largest batch that splits on this device allocates the bytes split_k_scratch_peak
    counts (up to the caching allocator's 512-byte rounding of its three tensors)."""
    from prefixkv.runner.memory import split_k_scratch_peak

    num_sms, heads, kv_heads, head_dim, max_len = _num_sms(), 32, 8, 128, 131072
    peak = split_k_scratch_peak(heads, kv_heads, head_dim, 256, max_len, num_sms)
    n = max(n for n in range(1, 257) if kernels.decode_split_k(n, kv_heads, heads // kv_heads, max_len, num_sms))
    q = torch.zeros((n, heads, head_dim), dtype=torch.bfloat16, device=DEVICE)
    out = torch.empty_like(q)
    cache = torch.zeros((2, 5, kv_heads, 16, head_dim), dtype=torch.bfloat16, device=DEVICE)
    tables = torch.zeros((n, 1), dtype=torch.int32, device=DEVICE)
    lens = torch.ones(n, dtype=torch.int32, device=DEVICE)
    kernels.paged_decode_attention(q, cache, tables, lens, 0.1, max_len, out=out)  # compiles
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    kernels.paged_decode_attention(q, cache, tables, lens, 0.1, max_len, out=out)
    torch.cuda.synchronize()
    allocated = torch.cuda.max_memory_allocated() - before
    assert peak <= allocated <= peak + 3 * 512, (n, peak, allocated)
