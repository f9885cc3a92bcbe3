"""CPU-side logic of the CUDA-graph runner: bucket sizes, and what a replay puts in the static
input buffers (real rows copied in, padding rows pointed at the dummy block) -- with a stand-in
for the captured graph, since capturing needs a GPU (tests/gpu covers that)."""

import pytest
import torch

from prefixkv.attention import AttentionMetadata, kv_cache_shape
from prefixkv.runner.cuda_graph import CudaGraphRunner, decode_buckets


def test_buckets():
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert decode_buckets(12) == [1, 2, 4, 8, 16]
    assert decode_buckets(3) == [1, 2, 3]
    assert decode_buckets(1) == [1]
    assert decode_buckets(20) == [1, 2, 4, 8, 16, 24]


class _RecordingGraph:
    """Stands in for a captured graph: a replay snapshots the static inputs it would read."""

    def __init__(self, runner: CudaGraphRunner, b: int) -> None:
        self.runner, self.b, self.seen = runner, b, None

    def replay(self) -> None:
        r, b = self.runner, self.b
        self.seen = dict(input_ids=r.input_ids[:b].clone(), positions=r.positions[:b].clone(),
                         slot_mapping=r.slot_mapping[:b].clone(), seq_lens=r.seq_lens[:b].clone(),
                         block_tables=r.block_tables[:b].clone())
        r.outputs[b].copy_(torch.arange(b, dtype=torch.float32)[:, None].expand(b, 5))


def _runner(max_num_seqs=12, num_blocks=10, block_size=4, max_model_len=32):
    kv_cache = torch.zeros(kv_cache_shape(1, num_blocks, 1, block_size, 8))
    runner = CudaGraphRunner(model=None, backend=None, kv_cache=kv_cache, max_num_seqs=max_num_seqs,
                             max_model_len=max_model_len, block_size=block_size)
    for b in runner.buckets:
        runner.graphs[b] = _RecordingGraph(runner, b)
        runner.outputs[b] = torch.zeros(b, 5)
    return runner


def _meta(tables, seq_lens, block_size=4):
    slots = [t[(L - 1) // block_size] * block_size + (L - 1) % block_size for t, L in zip(tables, seq_lens)]
    width = max(len(t) for t in tables)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.arange(len(tables) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        num_decode_seqs=len(tables), max_seq_len=32, max_query_len=1)


def test_replay_copies_inputs_and_points_padding_rows_at_the_dummy_block():
    runner = _runner()
    assert runner.dummy_block == 10 and runner.buckets == [1, 2, 4, 8, 16]
    # 5 sequences -> bucket 8: rows 5..7 are padding
    tables = [[0, 1], [2], [3, 4, 5], [6], [7, 8]]
    seq_lens = [6, 2, 11, 4, 5]
    meta = _meta(tables, seq_lens)
    ids, pos = torch.tensor([11, 12, 13, 14, 15]), torch.tensor([5, 1, 10, 3, 4])
    logits = runner.replay(ids, pos, meta)
    seen = runner.graphs[8].seen
    assert logits.shape == (5, 5) and logits[:, 0].tolist() == [0, 1, 2, 3, 4]  # a view of the graph's output
    assert seen["input_ids"].tolist() == [11, 12, 13, 14, 15, 0, 0, 0]
    assert seen["positions"].tolist() == [5, 1, 10, 3, 4, 0, 0, 0]
    assert seen["seq_lens"].tolist() == seq_lens + [1, 1, 1]
    assert seen["slot_mapping"].tolist() == meta.slot_mapping.tolist() + [40, 40, 40]  # dummy block, offset 0
    assert seen["block_tables"][:5, :3].tolist() == meta.block_tables.tolist()
    assert (seen["block_tables"][5:, 0] == 10).all()

    # smaller batches next replay their own buckets, from the same static buffers
    meta2 = _meta([[9]], [3])
    runner.replay(torch.tensor([7]), torch.tensor([2]), meta2)
    seen = runner.graphs[1].seen
    assert seen["input_ids"].tolist() == [7] and seen["block_tables"][0, 0] == 9
    runner.replay(torch.tensor([7, 8]), torch.tensor([2, 0]), _meta([[9], [1]], [3, 1]))
    assert runner.graphs[2].seen["slot_mapping"].tolist() == [38, 4]


def test_replay_refuses_what_no_graph_fits():
    runner = _runner(max_num_seqs=2)
    meta = _meta([[0], [1], [2]], [1, 1, 1])
    with pytest.raises(ValueError, match="buckets"):
        runner.replay(torch.tensor([1, 2, 3]), torch.tensor([0, 0, 0]), meta)


# ---- the split-K choice: the same eagerly and in a bucket's graph --------------------------------


class _AttentionGraph:
    """Stands in for a captured graph: a replay runs the attention backend on the static inputs
    (the bucket's padded metadata), as the graph's kernels would."""

    def __init__(self, runner: CudaGraphRunner, b: int, q: torch.Tensor) -> None:
        self.runner, self.b, self.q = runner, b, q

    def replay(self) -> None:
        r, b = self.runner, self.b
        q = self.q[:b]
        k = v = q[:, : r.kv_cache.shape[3]]
        self.out = r.backend.forward(q, k, v, r.kv_cache[0], r._meta(b), 0.125)
        r.outputs[b].zero_()


def _graph_runner_with_attention(num_kv_heads, queries_per_kv, max_num_seqs, max_model_len, head_dim=64,
                                 block_size=16, num_blocks=None):
    from prefixkv.attention.cuda import CudaAttentionBackend

    num_blocks = num_blocks or max_num_seqs * -(-max_model_len // block_size)
    kv_cache = torch.zeros(kv_cache_shape(1, num_blocks, num_kv_heads, block_size, head_dim))
    runner = CudaGraphRunner(model=None, backend=CudaAttentionBackend(), kv_cache=kv_cache, max_num_seqs=max_num_seqs,
                             max_model_len=max_model_len, block_size=block_size)
    q = torch.randn(runner.buckets[-1], num_kv_heads * queries_per_kv, head_dim)
    for b in runner.buckets:
        runner.graphs[b] = _AttentionGraph(runner, b, q)
        runner.outputs[b] = torch.zeros(b, 5)
    return runner, q


def _decode_meta(seq_lens, block_size, max_model_len, num_blocks):
    """A decode batch's metadata as ModelRunner.prepare builds it on CUDA (max_seq_len: max_model_len)."""
    n = len(seq_lens)
    width = -(-max(seq_lens) // block_size)
    tables = (torch.arange(n * width, dtype=torch.int32) % num_blocks).view(n, width)
    slots = [int(tables[i, (L - 1) // block_size]) * block_size + (L - 1) % block_size for i, L in enumerate(seq_lens)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables, num_decode_seqs=n,
        max_seq_len=max_model_len, max_query_len=1, seq_lens_cpu=list(seq_lens),
        query_start_loc_cpu=list(range(n + 1)))


def test_decode_kernels_are_the_same_eagerly_and_in_a_graph_bucket():
    """For every batch size up to max_num_seqs, the decode rows launch the same kernels (split-K or
    not) when they run eagerly and when they replay their bucket's graph padded with dummy rows:
    e.g. 25 decodes with 8 KV heads on 108 SMs used to split eagerly (200 CTAs < 2 waves) but not
    in bucket 32 (256 CTAs)."""
    from kernel_emu import emulated

    max_model_len, block_size = 2048, 16
    runner, q = _graph_runner_with_attention(8, 4, 64, max_model_len, block_size=block_size, num_blocks=200)
    chosen = {}
    for n in range(1, 65):
        meta = _decode_meta([1 + (37 * i) % 1500 for i in range(n)], block_size, max_model_len, 200)
        eager, graph = set(), set()
        with emulated(None, num_sms=108, record=eager):
            runner.backend.forward(q[:n], q[:n, :8], q[:n, :8], runner.kv_cache[0], meta, 0.125)
        with emulated(None, num_sms=108, record=graph):
            runner.replay(torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64), meta)
        assert eager == graph, (n, runner.bucket_for(n), eager ^ graph)
        chosen[n] = any("true>" in name for name in eager)
    assert chosen[25] is False and chosen[24] is True  # 24 rows: 192 CTAs < 216; 25 -> 32 rows: 256

    from prefixkv.attention.cuda import padded_decode_batch

    for max_num_seqs in range(1, 300):  # each bucket lies within one rounding class
        buckets = decode_buckets(max_num_seqs)
        for n in range(1, max_num_seqs + 1):
            b = next(b for b in buckets if b >= n)
            assert padded_decode_batch(n) == padded_decode_batch(b), (max_num_seqs, n, b)


def test_replay_refuses_a_sequence_longer_than_max_model_len():
    """The graphs' split-K grid covers max_model_len tokens: a longer sequence is refused, not cut."""
    runner = _runner(max_model_len=30)  # 8 blocks of 4 per sequence
    meta = _meta([[0, 1, 2, 3, 4, 5, 6, 7]], [31])
    meta.seq_lens_cpu = [31]
    with pytest.raises(ValueError, match="longer than the graphs' max_model_len 30"):
        runner.replay(torch.tensor([1]), torch.tensor([30]), meta)
    assert runner.num_filled == 0  # refused before any static input changed
