"""The decoder layers of a float32 Llama-shaped model as one C call on CPU.

``decoder_layers_f32`` (prefixkv/csrc/cpu_ops.c) runs every layer's kernels — residual-add +
RMSNorm, the qkv GEMM, RoPE, the KV write, decode attention, o_proj, RMSNorm, gate/up, SiLU·mul,
down — in the order LlamaModel.forward's Python loop calls them, in one call on cpu_ops.c's team
of threads (a phase a kernel, shares taken by whichever thread runs: the calling thread never
waits for one the OS has not started). The loop costs ~11 ctypes calls a layer, each with its
wrapper's checks, one or two allocations and a parallel region of its own; on a 2-core VM that is
several milliseconds of a decode step (bench/RESULTS.md, 2026-12-02, `7122a1b`). Every kernel
computes each row (or panel, or element) on its own, so the results are bitwise those of the
Python loop (tests/test_fused_stack.py).

It takes the steps the C decode kernel serves alone: every row one query token with its own
block-table row and context length, i.e. decode steps, and in batch-invariant mode (the CPU
default) any step, since then every prefill token is such a row too (``token_rows``). Other steps,
and models with anything the driver does not do (windows, soft caps, q/k norms, partial rotary,
Gemma's norms and GeGLU, MoE layers, per-layer RoPE tables), keep the Python loop.
``PREFIXKV_FUSED_STACK=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from prefixkv import cpu_ops
from prefixkv.attention.base import AttentionMetadata, prefix_order, token_rows

if TYPE_CHECKING:
    from prefixkv.model.llama import LlamaModel


def blocker(model: "LlamaModel") -> str | None:
    """Why this model's layers cannot run as one C call (None: they can)."""
    s = model.shape
    if os.environ.get("PREFIXKV_FUSED_STACK", "1") == "0":
        return "PREFIXKV_FUSED_STACK=0"
    lib = cpu_ops.load()
    if lib is None or lib.vector_bits == 0:
        return "no AVX-512 / AVX2 build of the C kernels"
    if model.model.embed_tokens.weight.dtype != torch.float32 or model.model.embed_tokens.weight.device.type != "cpu":
        return "float32 on CPU only"
    if s.gemma or s.qk_norm or s.rotary_dim or s.is_moe or s.hidden_act != "silu" or s.attn_softcap is not None:
        return f"{s.model_type}'s layers have parts the driver does not run"
    # (a model without sliding windows has one KV cache group: every layer one metadata)
    if any(w is not None for w in s.layer_windows) or len(set(model.layer_rope)) != 1:
        return "sliding windows or per-layer RoPE tables"
    if s.head_dim not in (64, 128) or s.num_heads > lib.limits[0] or s.num_heads % s.num_kv_heads:
        return f"head_dim {s.head_dim}, {s.num_heads} heads"
    if s.num_layers > lib.decoder_layers_max():
        return f"{s.num_layers} layers (the C call takes {lib.decoder_layers_max()})"
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        if not (a.fused_rope and m.fused_act and layer.input_layernorm.fused and layer.post_attention_layernorm.fused):
            return "the C elementwise kernels are off"
        parts = (getattr(a, "qkv_proj", None), a.o_proj, getattr(m, "gate_up_proj", None), m.down_proj)
        if any(p is None or p.kind != "c" for p in parts) or m.gate_up_proj.bias is not None or m.down_proj.bias is not None:
            return "the projections are not the C GEMM's packed weights"
    return None


class FusedStack:
    """The layer table for ``decoder_layers_f32`` over the layers' KV caches (built once: weight
    and cache addresses do not move), and the per-step call."""

    def __init__(self, model: "LlamaModel", kv_caches: Sequence[torch.Tensor]) -> None:
        s = model.shape
        assert all(c.is_contiguous() and c.dtype == torch.float32 for c in kv_caches)
        self.kv_caches = kv_caches  # per layer: [2, num_blocks + 1, KVH, block_size, D]
        self.shape = s
        self.block_size = kv_caches[0].shape[3]
        self.nb1 = kv_caches[0].shape[1]
        self.scale = model.model.layers[0].self_attn.scale
        n = s.num_layers
        self.layers = (cpu_ops.DecoderLayerF32 * n)()
        self._keep = []  # the tensors the table points into (besides the KV caches)
        for i, layer in enumerate(model.model.layers):
            a, m = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm._kernel_weight().contiguous(),
                     layer.post_attention_layernorm._kernel_weight().contiguous())
            e = self.layers[i]
            e.input_norm, e.post_attention_norm = norms[0].data_ptr(), norms[1].data_ptr()
            e.qkv, e.qkv_bias = a.qkv_proj.packed.data_ptr(), _ptr(a.qkv_proj.bias)
            e.o, e.o_bias = a.o_proj.packed.data_ptr(), _ptr(a.o_proj.bias)
            e.gate_up, e.down = m.gate_up_proj.packed.data_ptr(), m.down_proj.packed.data_ptr()
            e.kv_layer = kv_caches[i].data_ptr()
            self._keep += [*norms, a.qkv_proj.packed, a.o_proj.packed, m.gate_up_proj.packed, m.down_proj.packed]
            self._keep += [b for b in (a.qkv_proj.bias, a.o_proj.bias) if b is not None]
        self.fn = cpu_ops.load().decoder_layers_f32
        # the workspaces of the last call: residual, normed, qkv, attn, o_out, gate_up, act [T, ...]
        # (the residual is returned: the caller reads it before the next call)
        self._work: tuple[torch.Tensor, ...] | None = None

    @staticmethod
    def rows(meta: AttentionMetadata, batch_invariant: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Each token's block-table row and context length, and the order the attention takes the
        rows in (``prefix_order``), or None where the step has prefill tokens that the decode
        kernel does not compute outside batch-invariant mode."""
        if meta.num_decode_seqs == meta.num_seqs:
            return meta.block_tables.contiguous(), meta.seq_lens.contiguous(), prefix_order(meta)
        if not batch_invariant:
            return None
        return (*token_rows(meta, 0), prefix_order(meta))

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                 tables: torch.Tensor, lens: torch.Tensor, order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, hidden] (the embeddings; overwritten) -> (the last layer's MLP output, the
        residual stream before it), as LlamaModel.forward's loop returns them."""
        s = self.shape
        t = h.shape[0]
        assert h.is_contiguous() and h.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
        assert tables.dtype == torch.int32 and lens.dtype == torch.int32 and tables.shape[0] == t == lens.shape[0]
        assert order.dtype == torch.int32 and order.shape == (t,) and order.is_contiguous()
        slots = meta.slot_mapping.contiguous()
        assert slots.dtype == torch.int64 and slots.shape == (t,)
        d, hid, inter = s.head_dim, s.hidden_size, s.intermediate_size
        if self._work is None or self._work[0].shape[0] != t:  # (a decode batch keeps its size for many steps)
            f32 = torch.float32
            self._work = None  # (the old set freed first)
            self._work = tuple(torch.empty((t, n), dtype=f32) for n in (
                hid, hid, (s.num_heads + 2 * s.num_kv_heads) * d, s.num_heads * d, hid, 2 * inter, inter))
        residual, normed, qkv, attn, o_out, gate_up, act = self._work
        st = cpu_ops.DecoderStepF32(
            T=t, hidden=hid, H=s.num_heads, KVH=s.num_kv_heads, D=d, BS=self.block_size, inter=inter,
            max_blocks=tables.shape[1], nb1=self.nb1, eps=s.rms_norm_eps, scale=self.scale,
            h=h.data_ptr(), residual=residual.data_ptr(), normed=normed.data_ptr(), qkv=qkv.data_ptr(),
            attn=attn.data_ptr(), o_out=o_out.data_ptr(), gate_up=gate_up.data_ptr(), act=act.data_ptr(),
            cos=cos.data_ptr(), sin=sin.data_ptr(), slots=slots.data_ptr(), block_tables=tables.data_ptr(),
            seq_lens=lens.data_ptr(), row_order=order.data_ptr())
        if not self.fn(self.layers, s.num_layers, ctypes.byref(st)):
            raise RuntimeError("decoder_layers_f32 refused shapes that blocker() accepted")
        return h, residual


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
