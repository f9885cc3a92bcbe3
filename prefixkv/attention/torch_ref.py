"""Reference paged attention in plain torch (the CPU path, and what the CUDA kernels are checked
against). Decodes are batched into one padded gather; prefill chunks run per sequence through
``scaled_dot_product_attention`` with a causal mask offset by the already computed tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from prefixkv.attention.base import AttentionBackend, AttentionMetadata


def write_kv(kv_cache_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V ([T, KVH, D]) into the cache at ``slot_mapping`` ([T])."""
    block_size = kv_cache_layer.shape[3]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    kv_cache_layer[0, blocks, :, offsets] = k
    kv_cache_layer[1, blocks, :, offsets] = v


def gather_kv(kv_cache_layer: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's context: ([KVH, seq_len, D], [KVH, seq_len, D])."""
    block_size = kv_cache_layer.shape[3]
    nb = -(-seq_len // block_size)
    kv = kv_cache_layer[:, block_table[:nb]]  # [2, nb, KVH, bs, D]
    kv = kv.permute(0, 2, 1, 3, 4).reshape(2, kv.shape[2], nb * block_size, kv.shape[4])
    return kv[0, :, :seq_len], kv[1, :, :seq_len]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, kv_cache_layer, meta: AttentionMetadata, scale: float):
        write_kv(kv_cache_layer, k, v, meta.slot_mapping)
        out = torch.empty_like(q)  # [T, H, D]
        nd = meta.num_decode_seqs
        if nd:
            out[:nd] = self._decode(q[:nd], kv_cache_layer, meta.block_tables[:nd], meta.seq_lens_cpu[:nd], scale)
        starts = meta.query_start_loc_cpu
        for s in range(nd, meta.num_seqs):
            a, b = starts[s], starts[s + 1]
            seq_len = meta.seq_lens_cpu[s]
            kk, vv = gather_kv(kv_cache_layer, meta.block_tables[s], seq_len)
            out[a:b] = self._prefill(q[a:b], kk, vv, seq_len, scale)
        return out

    @staticmethod
    def _prefill(q, k, v, seq_len: int, scale: float):
        # q [Q, H, D]; k, v [KVH, L, D]
        nq = q.shape[0]
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
        kh, vh = k.unsqueeze(0), v.unsqueeze(0)  # [1, KVH, L, D]
        gqa = qh.shape[1] != kh.shape[1]
        if nq == seq_len:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            # query i sits at position seq_len - nq + i and sees keys 0 .. that position
            qpos = torch.arange(seq_len - nq, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= qpos[:, None]  # [Q, L]
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
        return o[0].transpose(0, 1)  # [Q, H, D]

    @staticmethod
    def _decode(q, kv_cache_layer, block_tables, seq_lens: list[int], scale: float):
        # q [B, H, D]: one query per sequence at its last position
        b, h, d = q.shape
        kvh, bs = kv_cache_layer.shape[2], kv_cache_layer.shape[3]
        max_len = max(seq_lens)
        nb = -(-max_len // bs)
        kv = kv_cache_layer[:, block_tables[:, :nb]]  # [2, B, nb, KVH, bs, D]
        kv = kv.permute(0, 1, 3, 2, 4, 5).reshape(2, b, kvh, nb * bs, d)
        keys, values = kv[0], kv[1]  # [B, KVH, L, D]
        g = h // kvh
        qg = q.view(b, kvh, g, d)  # [B, KVH, G, D]
        scores = torch.matmul(qg, keys.transpose(-1, -2)) * scale  # [B, KVH, G, L]
        lens = torch.tensor(seq_lens, device=q.device)
        pad = torch.arange(nb * bs, device=q.device)[None, :] >= lens[:, None]  # [B, L]
        scores.masked_fill_(pad[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores.float() if scores.dtype != torch.float64 else scores, dim=-1).to(q.dtype)
        return torch.matmul(probs, values).view(b, h, d)
