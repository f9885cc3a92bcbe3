"""The CPU reference attention backend against a token-by-token float64 reference, on batches whose
sequences share leading blocks (the cascade decode path: one group holding every row, several
groups, a row whose whole context is shared) mixed with prefill chunks."""

from __future__ import annotations

import pytest
import torch

from kernel_reference import reference_attention
from prefixkv.attention.base import AttentionMetadata
from prefixkv.attention.torch_ref import TorchAttentionBackend, decode_plan

BS, KVH, G, D = 4, 2, 3, 8


def make_case(prefixes: list[int], seq_lens: list[int], query_lens: list[int], shared_blocks: int, seed: int = 0):
    """A step's inputs: sequence s starts with the first ``shared_blocks`` blocks of group
    ``prefixes[s]``'s prefix (each group its own blocks), then blocks of its own. Returns
    (q, k, v, cache, meta, tables)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = 200
    cache = torch.randn((2, num_blocks + 1, KVH, BS, D), generator=g, dtype=torch.float64)
    free = iter(torch.randperm(num_blocks, generator=g).tolist())
    group_blocks: dict[int, list[int]] = {}
    tables = []
    for p, n in zip(prefixes, seq_lens):
        if p not in group_blocks:
            group_blocks[p] = [next(free) for _ in range(shared_blocks)]
        own = [next(free) for _ in range(-(-n // BS) - shared_blocks)]
        tables.append(group_blocks[p] + own)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    starts = [0]
    for ql in query_lens:
        starts.append(starts[-1] + ql)
    slots = [tables[s][pos // BS] * BS + pos % BS
             for s, (n, ql) in enumerate(zip(seq_lens, query_lens)) for pos in range(n - ql, n)]
    q = torch.randn((starts[-1], KVH * G, D), generator=g, dtype=torch.float64)
    k = torch.randn((starts[-1], KVH, D), generator=g, dtype=torch.float64)
    v = torch.randn((starts[-1], KVH, D), generator=g, dtype=torch.float64)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=block_tables,
        num_decode_seqs=next((i for i, ql in enumerate(query_lens) if ql != 1), len(query_lens)),
        max_seq_len=max(seq_lens), max_query_len=max(query_lens), seq_lens_cpu=list(seq_lens),
        query_start_loc_cpu=starts)
    return q, k, v, cache, meta, tables


def run_case(prefixes: list[int], seq_lens: list[int], query_lens: list[int], shared_blocks: int, seed: int = 0):
    q, k, v, cache, meta, _ = make_case(prefixes, seq_lens, query_lens, shared_blocks, seed)
    out = TorchAttentionBackend().forward(q, k, v, cache, meta, D ** -0.5)
    want = reference_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, D ** -0.5)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    return meta


def test_one_group_holds_every_decode_row():
    meta = run_case([0] * 5, [13, 17, 20, 9, 14], [1] * 5, shared_blocks=2)
    groups = meta.scratch["decode"].prefix_groups
    assert len(groups) == 1 and groups[0][0].tolist() == [0, 1, 2, 3, 4] and groups[0][1].numel() == 2


def test_several_groups_and_a_lone_row():
    meta = run_case([0, 1, 0, 2, 1, 0], [13, 17, 20, 11, 14, 12], [1] * 6, shared_blocks=2)
    rows = sorted(idx.tolist() for idx, _ in meta.scratch["decode"].prefix_groups)
    assert rows == [[0, 2, 5], [1, 4]]  # group 2 has one row: no shared pass


def test_rows_whose_whole_context_is_shared():
    # 8 tokens = exactly the 2 shared blocks: nothing of their own to attend to
    meta = run_case([0, 0, 0], [8, 8, 11], [1, 1, 1], shared_blocks=2)
    assert meta.scratch["decode"].suffix_pad[:2].all()


@pytest.mark.parametrize("seed", range(3))
def test_decodes_mixed_with_prefill_chunks(seed):
    run_case([0, 0, 1, 0, 1], [13, 17, 20, 16, 9], [1, 1, 5, 3, 9], shared_blocks=2, seed=seed)


def test_decode_plan_groups_by_exact_leading_blocks():
    tables = torch.tensor([[5, 6, 7, 1], [5, 6, 8, 2], [4, 6, 7, 0]])
    plan = decode_plan(tables, [16, 15, 12], 4)
    # rows 0 and 1 share blocks 5, 6 (row 2's 6, 7 are not leading blocks of the same run)
    assert [(idx.tolist(), b.tolist()) for idx, b in plan.prefix_groups] == [([0, 1], [5, 6])]
    assert plan.suffix_blocks.tolist() == [[7, 1, 0], [8, 2, 0], [4, 6, 7]]
    # a group is keyed by its first block and shares what all its rows share: a row with only
    # block 5 in common leaves fewer than 2 shared blocks, so nobody takes the shared pass
    tables = torch.tensor([[5, 6, 7, 1], [5, 6, 8, 2], [5, 9, 3, 0]])
    assert decode_plan(tables, [16, 15, 12], 4).prefix_groups == []


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("window,softcap", [(5, None), (1, None), (6, 2.0), (None, 1.5), (64, None)])
def test_sliding_window_and_softcap(backend, window, softcap):
    """Decodes and prefill chunks with a window and/or capped scores against the token-by-token
    reference; the blocks wholly outside every query's window hold NaN, so reading one would show."""
    from prefixkv.attention.cpu import CpuAttentionBackend

    seq_lens, query_lens = [13, 30, 21, 17, 40], [1, 1, 7, 17, 3]
    q, k, v, cache, meta, tables = make_case(list(range(5)), seq_lens, query_lens, shared_blocks=0, seed=1)
    q = q * 3
    for n, ql, t in zip(seq_lens, query_lens, tables):
        lo = 0 if window is None else max(0, n - ql - window + 1)
        for b in t[:lo // BS]:
            cache[:, b] = float("nan")
    block_tables = meta.block_tables
    impl = TorchAttentionBackend() if backend == "torch" else CpuAttentionBackend()
    out = impl.forward(q, k, v, cache, meta, D ** -0.5, window=window, softcap=softcap)
    want = reference_attention(q, cache, block_tables, meta.seq_lens, meta.query_start_loc, D ** -0.5,
                               window=window, softcap=softcap)
    assert not out.isnan().any()
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    plain = reference_attention(q, cache.nan_to_num(), block_tables, meta.seq_lens, meta.query_start_loc, D ** -0.5)
    if window == 64:  # wider than every context: plain causal attention
        torch.testing.assert_close(out, plain, rtol=0, atol=1e-12)
    else:
        assert not torch.allclose(out, plain)  # the window / cap is real
