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
