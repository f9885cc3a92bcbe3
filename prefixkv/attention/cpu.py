"""The CPU default: the torch reference path's structure with its attention in the C kernels of
``cpu_ops``. Decode rows: each sequence reads its own blocks in place through its block table (no
gather copies, no per-step plan), an online softmax a block at a time. Prefill chunks: tiles of
16 query tokens (8 on AVX2) against the blocks they see, lane-wise online softmax (float32).

Where the kernel library is not built (no C compiler), the dtype is not float32 (prefill) or the
shapes exceed the kernels' limits, those rows take the torch path unchanged.

Batch-invariant mode (``batch_invariant = True``, set by the engine; issue 14): every query token,
decode or prefill, goes through the one decode routine with its own context length (a prefill
token at position p attends to positions 0 .. p through its sequence's block table). A token's
attention is then the same sequence of float operations whether it is decoded, prefilled whole,
prefilled in chunks of any size, recomputed after preemption or verified as a speculative draft,
and whatever else is in the batch (the kernel's work item is one token, and its reductions depend
on that token's context length only)."""

from __future__ import annotations

import torch

from prefixkv import cpu_ops
from prefixkv.attention.base import AttentionMetadata, prefix_order, token_rows
from prefixkv.attention.torch_ref import TorchAttentionBackend


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        self.batch_invariant = False

    def batch_invariance_blocker(self, num_heads: int, block_size: int, head_dim: int,
                                 dtype: torch.dtype) -> str | None:
        """Why these shapes would leave the C kernel (so batch-invariant mode is off), or None."""
        lib = cpu_ops.load()
        if lib is None:
            return "needs the C kernels (no working C compiler, or PREFIXKV_CPU_KERNELS=0)"
        max_heads, max_block, max_head_dim = lib.limits
        if dtype != torch.float32 or num_heads > max_heads or block_size > max_block or head_dim > max_head_dim:
            return (f"the C attention kernel takes float32 with at most {max_heads} heads, block size "
                    f"{max_block} and head dim {max_head_dim}; got {dtype}, {num_heads} heads, block size "
                    f"{block_size}, head dim {head_dim}")
        return None

    def _write_kv(self, k, v, kv_cache_layer, meta: AttentionMetadata) -> None:
        # in C from the qkv views (the torch path copies k and v first, then two index_copy_)
        if not cpu_ops.kv_write(k, v, kv_cache_layer, meta.slot_mapping):
            super()._write_kv(k, v, kv_cache_layer, meta)

    @staticmethod
    def _decode_kernel_takes(q, kv_cache_layer) -> bool:
        return cpu_ops.supports_decode(q, kv_cache_layer) and q.stride(2) == 1 and q.stride(1) == q.shape[2]

    def _decode_rows(self, q, kv_cache_layer, meta: AttentionMetadata, scale: float, out,
                     window: int | None = None, softcap: float | None = None) -> None:
        if not self._decode_kernel_takes(q, kv_cache_layer):
            return super()._decode_rows(q, kv_cache_layer, meta, scale, out, window, softcap)
        nd = meta.num_decode_seqs
        cpu_ops.paged_decode_attention(q, kv_cache_layer, meta.block_tables[:nd], meta.seq_lens[:nd], scale, out,
                                       window, softcap, prefix_order(meta, 0, nd))

    def _prefill_rows(self, q, kv_cache_layer, meta: AttentionMetadata, scale: float, out,
                      window: int | None = None, softcap: float | None = None) -> None:
        nd = meta.num_decode_seqs
        if self.batch_invariant:
            return self._prefill_rows_as_decodes(q, kv_cache_layer, meta, scale, out, window, softcap)
        masked = window is not None or softcap is not None
        done = False
        if cpu_ops.supports_prefill(q, kv_cache_layer):
            if "prefill_qsl" not in meta.scratch:  # per step: prefill rows' start offsets from 0
                qsl = meta.query_start_loc[nd:]
                meta.scratch["prefill_qsl"] = (qsl - qsl[0]).to(torch.int32).contiguous()
            a = meta.query_start_loc_cpu[nd]
            done = cpu_ops.paged_prefill_attention(q[a:], kv_cache_layer, meta.block_tables[nd:], meta.seq_lens[nd:],
                                                   meta.scratch["prefill_qsl"], scale, out[a:], window, softcap)
        if done:
            return
        if masked and self._decode_kernel_takes(q, kv_cache_layer):  # windows / caps: per-token C decodes
            return self._prefill_rows_as_decodes(q, kv_cache_layer, meta, scale, out, window, softcap)
        super()._prefill_rows(q, kv_cache_layer, meta, scale, out, window, softcap)

    def _prefill_rows_as_decodes(self, q, kv_cache_layer, meta: AttentionMetadata, scale: float, out,
                                 window: int | None = None, softcap: float | None = None) -> None:
        """Every prefill query token as a decode row of its own (``token_rows``)."""
        nd = meta.num_decode_seqs
        tables, lens = token_rows(meta, nd)
        a = meta.query_start_loc_cpu[nd]
        cpu_ops.paged_decode_attention(q[a:], kv_cache_layer, tables, lens, scale, out[a:], window, softcap,
                                       prefix_order(meta, nd))
