"""The plain reference the attention kernels are checked against (tests/gpu on a GPU,
tests/test_kernel_emulation.py on the CPU emulator), and the random paged batches they run on."""

from __future__ import annotations

import torch


def reference_attention(q, kv_cache_layer, block_tables, seq_lens, query_start_loc, scale, first_seq=0,
                        window=None, softcap=None):
    """float64 causal attention of every query token, K/V gathered token by token via the block table.
    Rows of sequences before ``first_seq`` (and of sequences with no context) stay zero. ``window``:
    a query at p sees keys p - window < j <= p; ``softcap``: scores -> softcap * tanh(scores / softcap)."""
    q = q.detach().cpu().double()
    cache = kv_cache_layer.detach().cpu()
    num_heads, (num_kv_heads, block_size) = q.shape[1], cache.shape[2:4]
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    tables = block_tables.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        if s < first_seq or seq_len <= 0:
            continue
        q0, q1 = starts[s], starts[s + 1]
        ctx = seq_len - (q1 - q0)
        keys, values = [], []
        lo = 0 if window is None else max(0, ctx - window + 1)  # keys before lo: outside every window
        for pos in range(lo, seq_len):
            block, offset = tables[s][pos // block_size], pos % block_size
            keys.append(cache[0, block, :, offset])
            values.append(cache[1, block, :, offset])
        k = torch.stack(keys).double().repeat_interleave(num_heads // num_kv_heads, dim=1)  # [L, H, D]
        v = torch.stack(values).double().repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", q[q0:q1], k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        query_pos = ctx + torch.arange(q1 - q0)[:, None]
        key_pos = torch.arange(lo, seq_len)[None, :]
        hidden = key_pos > query_pos
        if window is not None:
            hidden |= key_pos <= query_pos - window
        scores = scores.masked_fill(hidden, float("-inf"))
        out[q0:q1] = torch.einsum("hnl,lhd->nhd", torch.softmax(scores, dim=-1), v)
    return out


def make_batch(dtype, head_dim, block_size, num_kv_heads, queries_per_kv, specs, seed=0, device="cpu"):
    """specs: [(seq_len, query_len)], decodes (query_len 1) first. The contexts' K/V are in the cache
    (random, shuffled blocks); every other slot is NaN, so a kernel that reads past a context (or
    multiplies a masked-out value by zero instead of skipping it) fails loudly. Returns a dict of
    tensors on ``device``."""
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
        cache=cache.to(dtype).to(device), q=q.to(dtype).to(device), block_tables=tables.to(device),
        seq_lens=torch.tensor([L for L, _ in specs], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        num_decodes=num_decodes, max_seq_len=max(L for L, _ in specs), max_query_len=max(ql for _, ql in specs),
    )


def forward_inputs(dtype, head_dim, block_size, num_kv_heads, queries_per_kv, specs, seed=0, device="cpu"):
    """A batch plus this step's k/v: q, k, v are views of one fused qkv projection (strided rows).
    Returns (batch, q, k, v, metadata, the cache as it must be after the K/V write)."""
    from prefixkv.attention.base import AttentionMetadata

    b = make_batch(dtype, head_dim, block_size, num_kv_heads, queries_per_kv, specs, seed, device)
    num_tokens, num_heads = b["q"].shape[:2]
    gen = torch.Generator().manual_seed(seed + 1)
    qkv = torch.randn((num_tokens, (num_heads + 2 * num_kv_heads) * head_dim), generator=gen).to(dtype).to(device)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    q.copy_(b["q"])
    k = qkv[:, num_heads * head_dim: (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    tables = b["block_tables"].tolist()
    slots = [tables[s][pos // block_size] * block_size + pos % block_size
             for s, (seq_len, query_len) in enumerate(specs) for pos in range(seq_len - query_len, seq_len)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device), query_start_loc=b["query_start_loc"],
        seq_lens=b["seq_lens"], block_tables=b["block_tables"], num_decode_seqs=b["num_decodes"],
        max_seq_len=b["max_seq_len"], max_query_len=b["max_query_len"])
    want_cache = b["cache"].clone()
    for t, slot in enumerate(slots):
        want_cache[0, slot // block_size, :, slot % block_size] = k[t]
        want_cache[1, slot // block_size, :, slot % block_size] = v[t]
    return b, q, k, v, meta, want_cache
