"""The attention backend interface and the one KV-cache layout.

KV layout (read by the torch reference and by the CUDA kernels alike)::

    kv_cache: [num_layers, 2, num_blocks + 1, num_kv_heads, block_size, head_dim]
              axis 1: 0 = keys, 1 = values
              block `num_blocks` (the last one) is a reserved dummy block: padding rows
              (CUDA-graph buckets) write their K/V there and attend to it alone (their
              outputs are discarded); no real sequence's block table names it.

    kv_cache[layer] -> [2, num_blocks + 1, num_kv_heads, block_size, head_dim]

A token's KV lives at *slot* ``block_id * block_size + offset``; ``slot_mapping`` gives the slot
of every token scheduled this step.

Batch layout (one flattened batch of ``num_tokens`` query tokens)::

    seq 0 (decode) | seq 1 (decode) | ... | seq D-1 | seq D (prefill chunk ...) | seq D+1 ...
    <- num_decode_seqs seqs, 1 query token each ->   <- prefill seqs, query_len >= 1 each ->

A sequence's query tokens are its *last* ``query_len`` tokens: query token ``i`` of sequence ``s``
sits at position ``seq_lens[s] - query_len[s] + i`` and attends causally to positions
``0 .. seq_lens[s] - query_len[s] + i`` (cached prefix + earlier chunks + itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


def kv_cache_shape(
    num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int
) -> tuple[int, ...]:
    """Shape of the whole KV cache; ``num_blocks`` excludes the dummy block (added here)."""
    return (num_layers, 2, num_blocks + 1, num_kv_heads, block_size, head_dim)


@dataclass
class AttentionMetadata:
    """Per-step inputs shared by every layer. Sequences are ordered decodes first."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, slot of each query token's new KV
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32, context length incl. this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks_per_seq] int32, padded with 0
    num_decode_seqs: int  # the first num_decode_seqs sequences have query_len == 1
    max_seq_len: int
    max_query_len: int
    # CPU copies for Python-side loops of the reference backend (never read by kernels).
    seq_lens_cpu: list[int] | None = None
    query_start_loc_cpu: list[int] | None = None
    # Backend-private values derived once per step (by the first layer) and shared by all layers.
    scratch: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


def token_rows(meta: AttentionMetadata, first_seq: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The query tokens of sequences ``first_seq ..`` as decode rows of their own (the batch-invariant
    attention of the CPU and CUDA backends): ([tokens, max_blocks] int32, the block-table row of each
    token's sequence; [tokens] int32, each token's context length = its position + 1). Built once
    per step (cached in ``meta.scratch``)."""
    key = ("token_rows", first_seq)
    if key not in meta.scratch:
        qsl = meta.query_start_loc.to(torch.int64)
        qlens = qsl[first_seq + 1:] - qsl[first_seq:-1]
        num_tokens = (meta.query_start_loc_cpu[-1] - meta.query_start_loc_cpu[first_seq] if meta.query_start_loc_cpu
                      else int(qsl[-1] - qsl[first_seq]))
        dev = qsl.device
        seq = torch.repeat_interleave(torch.arange(first_seq, meta.num_seqs, device=dev), qlens, output_size=num_tokens)
        # position of each token in its sequence: tokens before this step's rows + its index among them
        ctx = meta.seq_lens[first_seq:].to(torch.int64) - qlens - (qsl[first_seq:-1] - qsl[first_seq])
        lens = torch.repeat_interleave(ctx, qlens, output_size=num_tokens) + torch.arange(num_tokens, device=dev) + 1
        meta.scratch[key] = (meta.block_tables.index_select(0, seq).contiguous(), lens.to(torch.int32).contiguous())
    return meta.scratch[key]


def prefix_order(meta: AttentionMetadata, first_seq: int = 0, last_seq: int | None = None) -> torch.Tensor:
    """The order in which the CPU decode kernel takes the rows of sequences ``first_seq .. last_seq - 1``
    (a decode sequence's one row; in batch-invariant mode each of a prefill's tokens, as
    ``token_rows`` lays them out): int32 [rows], a permutation of their indices from 0. The
    sequences sorted by their block tables (lexicographically, stable), so that rows reading the
    same cached prefix are taken one after another and a thread finds that prefix's blocks in its
    L2 instead of memory or L3; a sequence's tokens stay together and in order. Each row's result
    is the same bits in any order (cpu_ops.c, ``DECODE_ROW``). Built once per step (cached in
    ``meta.scratch``); the block tables are on the CPU."""
    last_seq = meta.num_seqs if last_seq is None else last_seq
    key = ("prefix_order", first_seq, last_seq)
    if key not in meta.scratch:
        tables = meta.block_tables[first_seq:last_seq].numpy()
        qsl = np.asarray(meta.query_start_loc_cpu if meta.query_start_loc_cpu is not None
                         else meta.query_start_loc.tolist(), dtype=np.int64)[first_seq:last_seq + 1]
        if tables.shape[1] == 0:  # (no blocks: nothing to group)
            order = np.arange(tables.shape[0])
        else:  # a row's block ids as one big-endian byte string: byte order is the ids' lexicographic order
            rows = np.ascontiguousarray(tables.astype(">u4")).view(np.dtype((np.void, 4 * tables.shape[1]))).ravel()
            order = np.argsort(rows, kind="stable")
        qlens = np.diff(qsl)
        if (qlens != 1).any():  # each sequence's tokens, in order, where the sorted sequences put them
            n = qlens[order]
            ends = np.cumsum(n)
            order = np.repeat(qsl[order] - qsl[0] - (ends - n), n) + np.arange(int(qsl[-1] - qsl[0]))
        meta.scratch[key] = torch.from_numpy(order.astype(np.int32))
    return meta.scratch[key]


class AttentionBackend:
    """Paged attention over the KV layout above.

    ``forward`` first writes this step's ``k``/``v`` into ``kv_cache_layer`` at ``slot_mapping``
    (so a sequence attends to its own new tokens), then computes causal attention of every query
    token against its sequence's context read through ``block_tables``. It never writes any slot
    not named in ``slot_mapping`` (copy-on-write relies on that), and the output equals dense
    causal softmax attention in the input dtype, accumulated in at least fp32.

    ``window`` (a sliding-window layer): a query at position p sees keys at p - window < j <= p
    only. ``softcap``: scores become ``softcap * tanh(score / softcap)`` before the softmax. A
    backend without them raises ``NotImplementedError`` (the engine refuses such models first).
    """

    name = "base"

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache_layer: torch.Tensor,  # [2, num_blocks + 1, num_kv_heads, block_size, head_dim]
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        raise NotImplementedError

    def copy_blocks(self, kv_cache: torch.Tensor, src_dst: torch.Tensor) -> None:
        """Copy whole blocks in every layer; ``src_dst`` is [num_copies, 2] int64 (src, dst)."""
        if src_dst.numel() == 0:
            return
        src, dst = src_dst[:, 0], src_dst[:, 1]
        kv_cache[:, :, dst] = kv_cache[:, :, src]
