"""The CPU default: the torch reference path (prefill chunks through SDPA), with decode rows
through the C kernel of ``cpu_ops`` — each sequence reads its own blocks in place through
its block table (no gather copies, no per-step plan), an online softmax a block at a time.

Where the kernel library is not built (no C compiler) or the shapes exceed its limits, decode
rows take the torch path (cascade attention) unchanged."""

from __future__ import annotations

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
