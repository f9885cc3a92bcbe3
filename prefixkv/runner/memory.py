"""How much device memory the KV cache may take (CUDA): the device's budget minus what is in use
(the weights, other processes) minus the activation peak of the largest step, profiled once."""

from __future__ import annotations

import torch


def kv_cache_bytes_for(total: int, free: int, utilization: float, activation_peak: int) -> int:
    """Bytes the KV cache may take on a device of ``total`` bytes with ``free`` left after the
    weights (other processes' use counts as used): ``utilization * total`` minus what is in use,
    minus the profiled activation peak of the largest step. ValueError if nothing is left."""
    budget = int(utilization * total) - (total - free) - activation_peak
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization: {utilization} of {total / 2**30:.1f} GiB leaves no room for "
                         f"the KV cache ({(total - free) / 2**30:.1f} GiB in use, activation peak "
                         f"{activation_peak / 2**30:.2f} GiB)")
    return budget


def profile_activation_peak(model, num_tokens: int, num_seqs: int) -> int:
    """Peak CUDA memory of a forward pass of the largest step (``num_tokens`` query tokens, prefill
    chunks over a scratch KV cache of one block per sequence), beyond what was allocated before."""
    from prefixkv.attention import AttentionMetadata, get_backend, kv_cache_shape

    dev = next(model.parameters()).device
    s = model.shape
    dtype = model.model.embed_tokens.weight.dtype
    n = max(1, min(num_seqs, num_tokens))
    per = -(-num_tokens // n)
    bs = per
    kv = torch.zeros(kv_cache_shape(s.num_layers, n, s.num_kv_heads, bs, s.head_dim), dtype=dtype, device=dev)
    starts = [min(i * per, num_tokens) for i in range(n + 1)]
    lens = [b - a for a, b in zip(starts, starts[1:])]
    meta = AttentionMetadata(
        slot_mapping=torch.cat([torch.arange(L, device=dev) + i * bs for i, L in enumerate(lens)]),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        block_tables=torch.arange(n, dtype=torch.int32, device=dev)[:, None],
        num_decode_seqs=0, max_seq_len=max(lens), max_query_len=max(lens), seq_lens_cpu=lens,
        query_start_loc_cpu=starts)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
    pos = torch.cat([torch.arange(L, device=dev) for L in lens])
    model(ids, pos, kv, meta, get_backend("torch"), torch.tensor([num_tokens - 1], device=dev))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del kv
    torch.cuda.empty_cache()
    return peak
