"""The CPU default: the torch reference path's structure with its attention in the C kernels of
``cpu_ops``. Decode rows: each sequence reads its own blocks in place through its block table (no
gather copies, no per-step plan), an online softmax a block at a time. Prefill chunks: tiles of
16 query tokens against the blocks they see, lane-wise online softmax (AVX-512, float32).

Where the kernel library is not built (no C compiler), the dtype is not float32 (prefill) or the
shapes exceed the kernels' limits, those rows take the torch path unchanged."""

from __future__ import annotations

import torch

from prefixkv import cpu_ops
from prefixkv.attention.base import AttentionMetadata
from prefixkv.attention.torch_ref import TorchAttentionBackend


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def _decode_rows(self, q, kv_cache_layer, meta: AttentionMetadata, scale: float, out) -> None:
        if not cpu_ops.supports_decode(q, kv_cache_layer) or q.stride(2) != 1 or q.stride(1) != q.shape[2]:
            return super()._decode_rows(q, kv_cache_layer, meta, scale, out)
        nd = meta.num_decode_seqs
        cpu_ops.paged_decode_attention(q, kv_cache_layer, meta.block_tables[:nd], meta.seq_lens[:nd], scale, out)

    def _prefill_rows(self, q, kv_cache_layer, meta: AttentionMetadata, scale: float, out) -> None:
        nd = meta.num_decode_seqs
        if not cpu_ops.supports_prefill(q, kv_cache_layer):
            return super()._prefill_rows(q, kv_cache_layer, meta, scale, out)
        if "prefill_qsl" not in meta.scratch:  # per step: prefill rows' start offsets from 0
            qsl = meta.query_start_loc[nd:]
            meta.scratch["prefill_qsl"] = (qsl - qsl[0]).to(torch.int32).contiguous()
        a = meta.query_start_loc_cpu[nd]
        done = cpu_ops.paged_prefill_attention(q[a:], kv_cache_layer, meta.block_tables[nd:], meta.seq_lens[nd:],
                                               meta.scratch["prefill_qsl"], scale, out[a:])
        if not done:
            super()._prefill_rows(q, kv_cache_layer, meta, scale, out)
