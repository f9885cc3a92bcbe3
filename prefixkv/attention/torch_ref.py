"""Reference paged attention in plain torch (the CPU path, and what the CUDA kernels are checked
against). Decodes are batched into one padded gather; prefill chunks run per sequence through
``scaled_dot_product_attention`` with a causal mask offset by the already computed tokens."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from prefixkv.attention.base import AttentionBackend, AttentionMetadata


def kv_rows(slot_mapping: torch.Tensor, num_kv_heads: int, block_size: int) -> torch.Tensor:
    """Row of each (token, kv head) in a layer viewed as [2, (num_blocks + 1) * KVH * block_size, D]."""
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    heads = torch.arange(num_kv_heads, device=slot_mapping.device) * block_size
    return (blocks[:, None] * (num_kv_heads * block_size) + heads[None, :] + offsets[:, None]).reshape(-1)


def write_kv(kv_cache_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             rows: torch.Tensor | None = None) -> None:
    """Scatter this step's K/V ([T, KVH, D]) into the cache at ``slot_mapping`` ([T]).

    A flat ``index_copy_`` (``cache[0, blocks, :, offsets] = k`` would copy the whole layer)."""
    _, _, kvh, block_size, d = kv_cache_layer.shape
    if rows is None:
        rows = kv_rows(slot_mapping, kvh, block_size)
    flat = kv_cache_layer.view(2, -1, d)
    flat[0].index_copy_(0, rows, k.reshape(-1, d))
    flat[1].index_copy_(0, rows, v.reshape(-1, d))


def gather_blocks(cache_half: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Keys (or values) of the listed blocks, token-major per head.

    cache_half: [num_blocks + 1, KVH, bs, D] (``kv_cache_layer[0]`` or ``[1]``); blocks: [..., nb].
    Returns [..., KVH, nb * bs, D]. Indexes the leading axis (a fast gather, unlike ``layer[:, blocks]``).
    """
    x = cache_half[blocks].transpose(-4, -3)  # [..., KVH, nb, bs, D]
    return x.reshape(*x.shape[:-3], x.shape[-3] * x.shape[-2], x.shape[-1])


def gather_kv(kv_cache_layer: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's context: ([KVH, seq_len, D], [KVH, seq_len, D])."""
    blocks = block_table[:-(-seq_len // kv_cache_layer.shape[3])]
    return (gather_blocks(kv_cache_layer[0], blocks)[:, :seq_len],
            gather_blocks(kv_cache_layer[1], blocks)[:, :seq_len])


class DecodePlan(NamedTuple):
    """Per-step decode layout, the same for every layer (built once, by the first layer).

    Sequences whose block tables start with the same run of full blocks (a shared system prompt,
    n > 1 samples) form a group: they attend to that shared prefix in one matmul over one copy
    of its K/V, then each to its own remaining ("suffix") blocks."""

    prefix_groups: list[tuple[torch.Tensor, torch.Tensor]]  # (rows [n], shared block ids [nb])
    suffix_blocks: torch.Tensor  # [B, nb_max] int64, padded with 0
    suffix_pad: torch.Tensor  # [B, nb_max * block_size] bool, True past a sequence's suffix


def decode_plan(block_tables: torch.Tensor, seq_lens: list[int], block_size: int) -> DecodePlan:
    b = len(seq_lens)
    tables = block_tables.tolist()
    num_full = [n // block_size for n in seq_lens]
    shared = [0] * b
    groups: dict[int, list[int]] = {}
    for r in range(b):
        if num_full[r]:
            groups.setdefault(tables[r][0], []).append(r)
    dev = block_tables.device
    prefix_groups = []
    for rows in groups.values():
        if len(rows) < 2:
            continue
        n = min(num_full[r] for r in rows)
        first = tables[rows[0]]
        for r in rows[1:]:
            t, m = tables[r], 0
            while m < n and t[m] == first[m]:
                m += 1
            n = m
        if n < 2:
            continue
        for r in rows:
            shared[r] = n
        prefix_groups.append((torch.tensor(rows, device=dev), torch.tensor(first[:n], device=dev)))
    suffix = [t[shared[r]:-(-seq_lens[r] // block_size)] for r, t in enumerate(tables)]
    nb = max(1, max(len(t) for t in suffix))
    suffix_blocks = torch.tensor([t + [0] * (nb - len(t)) for t in suffix], dtype=torch.int64, device=dev)
    lens = torch.tensor([seq_lens[r] - shared[r] * block_size for r in range(b)], device=dev)
    suffix_pad = torch.arange(nb * block_size, device=dev)[None, :] >= lens[:, None]
    return DecodePlan(prefix_groups, suffix_blocks, suffix_pad)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, kv_cache_layer, meta: AttentionMetadata, scale: float,
                window: int | None = None, softcap: float | None = None):
        nd = meta.num_decode_seqs
        self._write_kv(k, v, kv_cache_layer, meta)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, H, D]
        if nd:
            self._decode_rows(q[:nd], kv_cache_layer, meta, scale, out[:nd], window, softcap)
        if meta.num_seqs > nd:
            self._prefill_rows(q, kv_cache_layer, meta, scale, out, window, softcap)
        return out

    def _write_kv(self, k, v, kv_cache_layer, meta: AttentionMetadata) -> None:
        scratch = meta.scratch
        if "rows" not in scratch:  # first layer of the step: build what every layer shares
            scratch["rows"] = kv_rows(meta.slot_mapping, kv_cache_layer.shape[2], kv_cache_layer.shape[3])
        write_kv(kv_cache_layer, k, v, meta.slot_mapping, scratch["rows"])

    def _masked_rows(self, q, kv_cache_layer, meta: AttentionMetadata, scale: float, window: int | None,
                     softcap: float | None, out, seqs: range) -> None:
        """The query tokens of sequences ``seqs`` with a sliding window and/or soft-capped scores:
        per sequence, scores over the keys its window can reach (only those blocks are read), the
        mask, the cap, a softmax in the accumulation dtype. (Decode rows come first in the batch, so
        ``q[:num_decode_seqs]`` indexes them as the whole batch does.)"""
        starts = meta.query_start_loc_cpu
        bs = kv_cache_layer.shape[3]
        kvh = kv_cache_layer.shape[2]
        acc = _acc_dtype(q.dtype)
        for s in seqs:
            a, b = starts[s], starts[s + 1]
            seq_len = meta.seq_lens_cpu[s]
            first = seq_len - (b - a)  # position of the first query token
            lo = 0 if window is None else max(0, first - window + 1)  # the first key any query sees
            b0 = lo // bs
            blocks = meta.block_tables[s][b0:-(-seq_len // bs)]
            kk = gather_blocks(kv_cache_layer[0], blocks)[:, lo - b0 * bs:seq_len - b0 * bs]  # [KVH, L, D]
            vv = gather_blocks(kv_cache_layer[1], blocks)[:, lo - b0 * bs:seq_len - b0 * bs]
            nq, h, d = b - a, q.shape[1], q.shape[2]
            qg = q[a:b].view(nq, kvh, h // kvh, d).permute(1, 0, 2, 3).reshape(kvh, -1, d)  # [KVH, Q*G, D]
            scores = torch.matmul(qg, kk.transpose(-1, -2)).to(acc) * scale  # [KVH, Q*G, L]
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            qpos = torch.arange(first, seq_len, device=q.device).repeat_interleave(h // kvh)  # [Q*G]
            kpos = torch.arange(lo, seq_len, device=q.device)
            allowed = kpos[None, :] <= qpos[:, None]
            if window is not None:
                allowed &= kpos[None, :] > qpos[:, None] - window
            scores.masked_fill_(~allowed, float("-inf"))
            p = torch.softmax(scores, dim=-1).to(q.dtype)
            o = torch.matmul(p, vv)  # [KVH, Q*G, D]
            out[a:b] = o.view(kvh, nq, h // kvh, d).permute(1, 0, 2, 3).reshape(nq, h, d)

    def _prefill_rows(self, q, kv_cache_layer, meta: AttentionMetadata, scale: float, out,
                      window: int | None = None, softcap: float | None = None) -> None:
        """The prefill sequences' query tokens (rows from ``query_start_loc[num_decode_seqs]`` on)."""
        if window is not None or softcap is not None:
            return self._masked_rows(q, kv_cache_layer, meta, scale, window, softcap, out,
                                     range(meta.num_decode_seqs, meta.num_seqs))
        starts = meta.query_start_loc_cpu
        for s in range(meta.num_decode_seqs, meta.num_seqs):
            a, b = starts[s], starts[s + 1]
            seq_len = meta.seq_lens_cpu[s]
            kk, vv = gather_kv(kv_cache_layer, meta.block_tables[s], seq_len)
            out[a:b] = self._prefill(q[a:b], kk, vv, seq_len, scale)

    def _decode_rows(self, q, kv_cache_layer, meta: AttentionMetadata, scale: float, out,
                     window: int | None = None, softcap: float | None = None) -> None:
        """The first ``num_decode_seqs`` sequences' attention: q [nd, H, D] -> out [nd, H, D]."""
        if window is not None or softcap is not None:
            return self._masked_rows(q, kv_cache_layer, meta, scale, window, softcap, out,
                                     range(meta.num_decode_seqs))
        if "decode" not in meta.scratch:  # the plan is the same for every layer of the step
            nd = meta.num_decode_seqs
            meta.scratch["decode"] = decode_plan(meta.block_tables[:nd], meta.seq_lens_cpu[:nd],
                                                 kv_cache_layer.shape[3])
        out.copy_(self._decode(q, kv_cache_layer, meta.scratch["decode"], scale))

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
    def _decode(q, kv_cache_layer, plan: DecodePlan, scale: float):
        """Decode attention, one query per sequence at its last position. q [B, H, D] -> [B, H, D].

        Each sequence attends to its own suffix blocks; a group's shared prefix is attended once
        for all its members; the parts merge exactly through their softmax statistics (max, sum),
        as in cascade / shared-prefix attention::

            blocks  [ shared by the group ............ | own ........ ]
            out  =  merge(softmax-part(prefix),          softmax-part(suffix))
        """
        b, h, d = q.shape
        o, m, l = _partial_attention(q, kv_cache_layer, plan.suffix_blocks, plan.suffix_pad, scale)
        for idx, blocks in plan.prefix_groups:
            # a group holding every row (rows ascending) is indexed by a slice: views, no gather
            rows = slice(None) if idx.numel() == b else idx
            po, pm, pl = _prefix_attention(q[rows], kv_cache_layer, blocks, scale)
            mm = torch.maximum(m[rows], pm)
            a, pa = torch.exp(m[rows] - mm), torch.exp(pm - mm)
            o[rows] = o[rows] * a[..., None] + po * pa[..., None]
            l[rows] = l[rows] * a + pl * pa
        return (o / l[..., None]).to(q.dtype).view(b, h, d)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _partial_attention(q, kv_cache_layer, blocks: torch.Tensor, pad: torch.Tensor, scale: float):
    """Unnormalized attention of q [B, H, D] over each sequence's blocks ([B, nb]; positions where
    ``pad`` [B, nb * block_size] is True excluded). Returns o [B, KVH, G, D] (sum of exp(s - m) v),
    m and l [B, KVH, G]."""
    b, h, d = q.shape
    kvh = kv_cache_layer.shape[2]
    g = h // kvh
    acc = _acc_dtype(q.dtype)
    keys, values = gather_blocks(kv_cache_layer[0], blocks), gather_blocks(kv_cache_layer[1], blocks)  # [B, KVH, L, D]
    qg = q.view(b, kvh, g, d)  # [B, KVH, G, D]
    scores = torch.matmul(qg, keys.transpose(-1, -2)).to(acc) * scale  # [B, KVH, G, L]
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    m = scores.amax(dim=-1)  # [B, KVH, G]; -inf for a row with no tokens here
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(scores - m_safe[..., None])
    l = p.sum(dim=-1)
    o = torch.matmul(p.to(q.dtype), values).to(acc)  # [B, KVH, G, D]
    return o, m, l


def _prefix_attention(q, kv_cache_layer, blocks: torch.Tensor, scale: float):
    """Attention of q [n, H, D] over one shared run of full blocks ([nb]), read once for all n
    queries. Returns o [n, KVH, G, D] (unnormalized), m and l [n, KVH, G]."""
    n, h, d = q.shape
    kvh = kv_cache_layer.shape[2]
    g = h // kvh
    acc = _acc_dtype(q.dtype)
    keys, values = gather_blocks(kv_cache_layer[0], blocks), gather_blocks(kv_cache_layer[1], blocks)  # [KVH, L, D]
    qk = q.view(n, kvh, g, d).permute(1, 0, 2, 3).reshape(kvh, n * g, d)  # [KVH, n*G, D]
    scores = torch.matmul(qk, keys.transpose(-1, -2)).to(acc) * scale  # [KVH, n*G, L]
    m = scores.amax(dim=-1)
    p = torch.exp(scores - m[..., None])
    l = p.sum(dim=-1)
    o = torch.matmul(p.to(q.dtype), values).to(acc)  # [KVH, n*G, D]
    return (o.view(kvh, n, g, d).permute(1, 0, 2, 3), m.view(kvh, n, g).permute(1, 0, 2),
            l.view(kvh, n, g).permute(1, 0, 2))
