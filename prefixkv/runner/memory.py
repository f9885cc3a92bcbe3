"""How much device memory the KV cache may take (CUDA): the device's budget minus what is in use
(the weights, other processes) minus the activation peak of the largest step, profiled once, and
minus the CUDA decode kernel's split-K scratch (not in that profile: it runs the torch backend on
prefill chunks)."""

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


def split_k_scratch_peak(num_heads: int, num_kv_heads: int, head_dim: int, max_num_seqs: int, max_model_len: int,
                         num_sms: int) -> int:
    """The most split-K scratch the CUDA backend's decode attention holds at once (one layer's: it is
    freed after the layer's reduce): that of the largest decode batch, up to ``max_num_seqs``
    rounded up to its CUDA-graph bucket, that ``decode_split_k`` splits; 0 if none does. E.g.
    ~130 MiB for 32 heads of 128 (8 KV heads) at 128k tokens on 132 SMs (batches up to 32). (The
    batch-invariant attention, every token a split-K row, is not offered on CUDA.)"""
    from prefixkv.attention.cuda import decode_split_k, padded_decode_batch, split_k_scratch_bytes

    qpk = num_heads // num_kv_heads
    largest = max((n for n in range(1, padded_decode_batch(max_num_seqs) + 1)
                   if decode_split_k(n, num_kv_heads, qpk, max_model_len, num_sms)), default=0)
    return split_k_scratch_bytes(largest, num_heads, head_dim, max_model_len)


def cuda_kv_cache_bytes(model, attention_backend: str, utilization: float, max_num_batched_tokens: int,
                        max_num_seqs: int, max_model_len: int) -> int:
    """``kv_cache_bytes_for`` on this process's CUDA device: the activation peak profiled, plus the
    split-K scratch when the attention backend is "cuda"."""
    peak = profile_activation_peak(model, max_num_batched_tokens, max_num_seqs)
    if attention_backend == "cuda":
        s = model.shape
        num_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        peak += split_k_scratch_peak(s.num_heads, s.num_kv_heads, s.head_dim, max_num_seqs, max_model_len, num_sms)
    free, total = torch.cuda.mem_get_info()
    return kv_cache_bytes_for(total, free, utilization, peak)
