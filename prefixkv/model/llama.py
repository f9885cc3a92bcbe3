"""The decoder forward pass over a paged KV cache, one decoder for the families prefixkv serves,
their differences read from the HF config into ``ModelShape``: Llama (incl. Llama-3 RoPE
scaling), Mistral (sliding window), Qwen2 (qkv bias, windowed layers), Qwen3 (q/k RMSNorm per
head), Gemma 2 / 3 ((1 + w) norms around each branch, scaled embeddings, GeGLU, soft-capping,
RoPE per layer type), Phi-3 (partial rotary, LongRoPE), and sparse MoE MLPs (``model/moe.py``:
Mixtral, Qwen3-MoE). GQA, tied or untied embeddings, any head_dim; a layer's sliding window
(``ModelShape.layer_windows``) and score cap go to the attention backend with its query.

The arithmetic mirrors Hugging Face transformers' modeling code op for op (RMSNorm in fp32, RoPE
cos/sin in fp32 then cast), so that outputs are the model's own, not an approximation of them.
The whole batch is one flat run of tokens ([num_tokens, ...]); attention is the backend's job.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from prefixkv import cpu_ops, hugepages
from prefixkv.attention.base import AttentionBackend, AttentionMetadata
from prefixkv.model.linear import FusedLinear, Linear

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "mixtral", "qwen3_moe",
                           "phi3")
GEMMA = ("gemma2", "gemma3_text")


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    max_position_embeddings: int
    sliding_window: int | None  # the window of the windowed layers (None: no layer has one)
    # per layer: its sliding window (a query at position p sees keys p - W < j <= p) or None
    layer_windows: tuple[int | None, ...] = ()
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over head_dim on q and k, before RoPE
    o_proj_bias: bool = False
    # Gemma 2 / 3: (1 + weight) RMSNorms, four per layer (post-attention and post-MLP ones on the
    # branch outputs), embeddings scaled by sqrt(hidden), GeGLU, their own attention scale
    gemma: bool = False
    hidden_act: str = "silu"  # or "gelu_pytorch_tanh"
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    layer_rope: tuple[str, ...] = ()  # per layer: which RoPE table ("default", or a layer type)
    # sparse MoE (Mixtral, Qwen3-MoE): per layer whether its MLP is routed experts (model/moe.py)
    moe_layers: tuple[bool, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_renormalize: bool = True  # the top-k weights divided by their sum
    moe_weights_in_fp32: bool = False
    rotary_dim: int = 0  # Phi-3 / Phi-4-mini partial rotary: RoPE on the first rotary_dim dims (0: all)
    # LongRoPE (Phi-3): transformers uses the short factors while a sequence fits this many tokens
    # and recomputes everything with the long ones past it; prefixkv serves the short regime only
    longrope_short_max: int | None = None

    @property
    def is_moe(self) -> bool:
        return any(self.moe_layers)

    @classmethod
    def from_hf_config(cls, cfg) -> "ModelShape":
        model_type = getattr(cfg, "model_type", "llama")
        if model_type == "gemma3" and getattr(cfg, "text_config", None) is not None:
            raise ValueError("model: this Gemma 3 checkpoint is the multimodal one (Gemma3ForConditionalGeneration); "
                             "prefixkv serves text-only gemma3_text checkpoints (Gemma3ForCausalLM)")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"model: architecture {model_type!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        gemma = model_type in GEMMA
        act = (getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)) if gemma else \
            getattr(cfg, "hidden_act", "silu")
        if act not in ("silu", "gelu_pytorch_tanh") or (act != "silu" and model_type in ("mixtral", "qwen3_moe")):
            raise ValueError(f"model: hidden_act {act!r} is not supported for {model_type} "
                             f"({'silu' if model_type in ('mixtral', 'qwen3_moe') else 'silu, gelu_pytorch_tanh'})")
        if gemma and getattr(cfg, "use_bidirectional_attention", None):
            raise ValueError("model: use_bidirectional_attention (non-causal Gemma) is not supported")
        window = getattr(cfg, "sliding_window", None)
        if model_type in ("qwen2", "qwen3") and not getattr(cfg, "use_sliding_window", False):
            window = None
        types = getattr(cfg, "layer_types", None)
        if window is None:
            windows = (None,) * cfg.num_hidden_layers
        elif types is None:  # Mistral: every layer
            windows = (window,) * cfg.num_hidden_layers
        else:
            windows = tuple(window if t == "sliding_attention" else None for t in types)
        bias = bool(getattr(cfg, "attention_bias", False))
        moe: dict = {}
        if model_type == "mixtral":
            n = cfg.num_local_experts
            moe = dict(moe_layers=(True,) * cfg.num_hidden_layers, num_experts=n,
                       num_experts_per_tok=cfg.num_experts_per_tok, moe_intermediate_size=cfg.intermediate_size,
                       moe_renormalize=True, moe_weights_in_fp32=True)
        elif model_type == "qwen3_moe":
            dense = set(getattr(cfg, "mlp_only_layers", None) or ())
            step = getattr(cfg, "decoder_sparse_step", 1) or 1
            moe = dict(moe_layers=tuple(cfg.num_experts > 0 and i not in dense and (i + 1) % step == 0
                                        for i in range(cfg.num_hidden_layers)),
                       num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                       moe_intermediate_size=cfg.moe_intermediate_size,
                       moe_renormalize=bool(getattr(cfg, "norm_topk_prob", False)), moe_weights_in_fp32=False)
        if model_type == "qwen3_moe" and not getattr(cfg, "use_sliding_window", False):
            windows = (None,) * cfg.num_hidden_layers
        params = getattr(cfg, "rope_parameters", None) or {}
        per_type = types is not None and all(t in params for t in set(types))  # Gemma 3: a table per type
        # partial rotary: Phi-3's (transformers' other families ignore the field in their RoPE)
        partial = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)) \
            if model_type == "phi3" else 1.0
        rotary_dim = int(head_dim * partial)
        longrope = None
        if not per_type and params.get("rope_type") in ("longrope", "su"):
            longrope = params.get("original_max_position_embeddings") or cfg.original_max_position_embeddings
        rope = tuple(types) if per_type else ("default",) * cfg.num_hidden_layers
        return cls(
            model_type=model_type,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bias,
            max_position_embeddings=cfg.max_position_embeddings,
            sliding_window=window if any(w is not None for w in windows) else None,
            layer_windows=windows,
            qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe"),
            o_proj_bias=bias and model_type != "qwen2",  # Qwen2's o_proj never has one
            gemma=gemma,
            hidden_act=act,
            attn_scale=cfg.query_pre_attn_scalar ** -0.5 if gemma else None,
            # Gemma 3's config carries attn_logit_softcapping, but its attention never applies it
            attn_softcap=getattr(cfg, "attn_logit_softcapping", None) if model_type == "gemma2" else None,
            final_softcap=getattr(cfg, "final_logit_softcapping", None) if gemma else None,
            layer_rope=rope,
            rotary_dim=rotary_dim if rotary_dim < head_dim else 0,
            longrope_short_max=longrope,
            **moe,
        )


def rope_inv_freq(cfg, head_dim: int, layer_type: str = "default") -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling exactly as transformers computes them; for a
    config with a RoPE table per layer type (Gemma 3), that of ``layer_type``."""
    params = getattr(cfg, "rope_parameters", None) or {}
    typed = layer_type != "default"
    if typed:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        partial = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)) \
            if getattr(cfg, "model_type", None) == "phi3" else 1.0
        dim = int(head_dim * partial)
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu", **({"layer_type": layer_type} if typed else {}))
    return inv_freq.float(), float(scaling)


# On CPU in float32 the LM head runs as matmuls over slices of the vocabulary: MKL's sgemm with a
# few rows and a 49k-wide weight is ~30 % slower in one call than over 1,024-row slices, and each
# logit comes out bit-identical (tests/test_model.py; dgemm's float64 results are not, so float64
# keeps the single call).
_LM_HEAD_SLICE = 1024


def lm_head(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(h, weight)``: h [S, hidden], weight [vocab, hidden] -> [S, vocab]."""
    if h.device.type != "cpu" or h.dtype != torch.float32 or weight.shape[0] <= _LM_HEAD_SLICE:
        return F.linear(h, weight)
    out = torch.empty(h.shape[0], weight.shape[0], dtype=h.dtype, device=h.device)
    for w, o in zip(weight.split(_LM_HEAD_SLICE), out.split(_LM_HEAD_SLICE, dim=1)):
        torch.mm(h, w.t(), out=o)
    return out


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.fused = False  # the C kernel (float32 on CPU; LlamaModel.use_cpu_ops)

    def _kernel_weight(self) -> torch.Tensor:
        """What the C kernel multiplies the normalised rows by."""
        return self.weight

    def _torch_norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:  # the C kernel (rows of the last dim: [T, N], or q/k heads [T, H, D])
            return cpu_ops.add_rmsnorm(x.reshape(-1, x.shape[-1]), None, self._kernel_weight(), self.eps)[0].view(x.shape)
        return self._torch_norm(x)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(h), h) with h = x + residual (x when residual is None): the residual add of the
        layer before, fused into this norm on CPU."""
        if self.fused:
            return cpu_ops.add_rmsnorm(x, residual, self._kernel_weight(), self.eps)
        h = x if residual is None else x + residual
        return self(h), h


class GemmaRMSNorm(RMSNorm):
    """Gemma's: ``(1 + weight)``, the normalisation and the scaling both in float32, one cast at
    the end (a float64 model's norms run in float32 too, as transformers'). Fused (float32 on
    CPU): the C RMSNorm kernel with ``1 + weight`` as its weight (the same product), which also
    makes a row's result independent of the other rows (batch invariance)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__(hidden_size, eps)
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self._plus_one: tuple[torch.Tensor, torch.Tensor] | None = None  # (weight, 1 + weight in float32)

    def _kernel_weight(self) -> torch.Tensor:
        w = self.weight
        if self._plus_one is None or self._plus_one[0] is not w:
            self._plus_one = (w, (1.0 + w.detach().float()).contiguous())
        return self._plus_one[1]

    def _torch_norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


def make_norm(s: "ModelShape", size: int) -> nn.Module:
    return GemmaRMSNorm(size, s.rms_norm_eps) if s.gemma else RMSNorm(size, s.rms_norm_eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, s: ModelShape, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = s.num_heads, s.num_kv_heads, s.head_dim
        # the checkpoint's q/k/v_proj, fused into qkv_proj by LlamaModel.fuse_projections()
        self.q_proj = Linear(s.hidden_size, s.num_heads * s.head_dim, bias=s.attention_bias)
        self.k_proj = Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=s.attention_bias)
        self.v_proj = Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=s.attention_bias)
        self.o_proj = Linear(s.num_heads * s.head_dim, s.hidden_size, bias=s.o_proj_bias)
        if s.qk_norm:
            self.q_norm = make_norm(s, s.head_dim)
            self.k_norm = make_norm(s, s.head_dim)
        self.qk_norm = s.qk_norm
        self.window = s.layer_windows[layer] if s.layer_windows else None
        self.softcap = s.attn_softcap
        self.rotary_dim = s.rotary_dim  # 0: every dim
        self.scale = s.attn_scale if s.attn_scale is not None else s.head_dim ** -0.5
        self.fused_rope = False  # the C kernel, in place (LlamaModel.use_cpu_ops)

    def fuse(self) -> None:
        self.qkv_proj = FusedLinear.from_parts([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x, cos, sin, kv_cache_layer, meta: AttentionMetadata, backend: AttentionBackend):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x)  # [T, H * D], [T, KVH * D], [T, KVH * D]
        q = q.view(t, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        if self.qk_norm:  # per head, before RoPE (Qwen3)
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary_dim:  # the first rotary_dim dims of each head turn, the rest pass (Phi-3)
            cos, sin, r = cos.unsqueeze(1), sin.unsqueeze(1), self.rotary_dim
            q = torch.cat((q[..., :r] * cos + _rotate_half(q[..., :r]) * sin, q[..., r:]), dim=-1)
            k = torch.cat((k[..., :r] * cos + _rotate_half(k[..., :r]) * sin, k[..., r:]), dim=-1)
        elif self.fused_rope:  # bit-identical to the three torch ops below
            cpu_ops.rope_(q, cos, sin)
            cpu_ops.rope_(k, cos, sin)
        else:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, D]
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        if self.window is None and self.softcap is None:
            out = backend.forward(q, k, v, kv_cache_layer, meta, self.scale)  # [T, H, D]
        else:
            out = backend.forward(q, k, v, kv_cache_layer, meta, self.scale, window=self.window, softcap=self.softcap)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """The gated MLP (SwiGLU, or GeGLU for Gemma); also each expert of a sparse MoE layer."""

    def __init__(self, hidden_size: int, intermediate_size: int, gelu: bool = False) -> None:
        super().__init__()
        # the checkpoint's gate/up_proj, fused into gate_up_proj by LlamaModel.fuse_projections()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.gelu = gelu  # GeGLU (Gemma)
        self.fused_act = False  # SiLU-and-mul in C (float32 on CPU; LlamaModel.use_cpu_ops)

    def fuse(self) -> None:
        self.gate_up_proj = FusedLinear.from_parts([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_act:
            gate_up = self.gate_up_proj.whole(x)
            return self.down_proj(cpu_ops.gelu_tanh_mul(gate_up) if self.gelu else cpu_ops.silu_mul(gate_up))
        gate, up = self.gate_up_proj(x)  # [T, I] each
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act * up)


class DecoderLayer(nn.Module):
    def __init__(self, s: ModelShape, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(s, layer)
        if s.moe_layers and s.moe_layers[layer]:
            from prefixkv.model.moe import SparseMoE

            self.mlp = SparseMoE(s.hidden_size, lambda: MLP(s.hidden_size, s.moe_intermediate_size), s.num_experts,
                                 s.num_experts_per_tok, s.moe_renormalize, s.moe_weights_in_fp32)
        else:
            self.mlp = MLP(s.hidden_size, s.intermediate_size, gelu=s.hidden_act == "gelu_pytorch_tanh")
        self.input_layernorm = make_norm(s, s.hidden_size)
        self.post_attention_layernorm = make_norm(s, s.hidden_size)
        self.sandwich = s.gemma
        if s.gemma:
            self.pre_feedforward_layernorm = make_norm(s, s.hidden_size)
            self.post_feedforward_layernorm = make_norm(s, s.hidden_size)

    def forward(self, x, residual, cos, sin, kv_cache_layer, meta, backend):
        """Returns (this layer's MLP output, the residual stream before it): the residual add that
        ends the layer happens in the next norm (``add_forward``), as in vLLM. The values are
        transformers' ``h = x + attn(norm(x)); out = h + mlp(norm(h))``; Gemma's also normalise
        each branch's output: ``h = x + norm(attn(norm(x))); out = h + norm(mlp(norm(h)))``."""
        normed, residual = self.input_layernorm.add_forward(x, residual)
        attn = self.self_attn(normed, cos, sin, kv_cache_layer, meta, backend)
        if self.sandwich:
            h = residual + self.post_attention_layernorm(attn)
            return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h))), h
        normed, residual = self.post_attention_layernorm.add_forward(attn, residual)
        return self.mlp(normed), residual


class LlamaModel(nn.Module):
    """Parameter names follow Hugging Face's (``model.layers.0.self_attn.q_proj.weight`` ...)."""

    def __init__(self, shape: ModelShape, ropes: dict[str, tuple[torch.Tensor, float]]) -> None:
        super().__init__()
        self.shape = shape
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(shape, i) for i in range(shape.num_layers))
        self.model.norm = make_norm(shape, shape.hidden_size)
        if not shape.tie_word_embeddings:
            self.lm_head = Linear(shape.hidden_size, shape.vocab_size, bias=False)
        self.layer_rope = shape.layer_rope or ("default",) * shape.num_layers
        self.set_rope(ropes)
        self.packed_lm_head: Linear | None = None
        # the one-call layer driver (model/fused_stack.py): why not ("" = it runs; None = not yet
        # decided: after prepack / use_cpu_ops, which reset it), and its table for the KV cache
        self.fused_stack_blocker: str | None = None
        self._stack = None

    def set_rope(self, ropes: dict[str, tuple[torch.Tensor, float]], device: str | None = None) -> None:
        """The RoPE tables by kind (``rope_inv_freq``): inverse frequencies (fp32, as in
        transformers) and the attention scaling of each."""
        self.ropes = {k: (f.float().to(device) if device else f.float(), scale) for k, (f, scale) in ropes.items()}
        # rope()'s cos/sin tables on CPU, by (kind, dtype)
        self._rope_tables: dict[tuple[str, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def inv_freq(self) -> torch.Tensor:
        return self.ropes["default"][0] if "default" in self.ropes else next(iter(self.ropes.values()))[0]

    def fuse_projections(self) -> None:
        """q/k/v and gate/up as one GEMM each (after the checkpoint's weights are loaded)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def use_cpu_ops(self, enabled: bool = True) -> bool:
        """The C kernels of cpu_ops for RoPE (float32 and float64: bit-identical to the torch ops)
        and, in float32, for residual-add + RMSNorm and SiLU-and-mul (float32 rounding apart).
        Only on CPU and where the kernel library builds; returns whether any is on."""
        dtype = self.model.embed_tokens.weight.dtype
        ok = enabled and self.inv_freq.device.type == "cpu" and cpu_ops.load() is not None
        rope = ok and dtype in (torch.float32, torch.float64)
        f32 = ok and dtype == torch.float32
        for layer in self.model.layers:
            layer.self_attn.fused_rope = rope
            layer.mlp.fused_act = f32  # SiLU-and-mul or GeGLU in C
        for m in self.modules():  # every norm: the layers', q/k per head, Gemma's (1 + w) ones, the final
            if isinstance(m, RMSNorm):
                m.fused = f32
        self.fused_stack_blocker, self._stack = None, None
        return rope

    def prepack(self, kind: str) -> bool:
        """On CPU in float32: every projection and the LM head run as GEMMs on prepacked weights,
        ``kind`` "c" (the C kernel) or "onednn" (see linear.py). Returns whether it packed."""
        w = self.lm_head_weight()
        if w.device.type != "cpu" or w.dtype != torch.float32:
            return False
        todo = [m for m in self.modules()
                if isinstance(m, Linear) and m.packed is None and m is not getattr(self, "lm_head", None)]
        head = Linear(self.shape.hidden_size, self.shape.vocab_size)
        head.weight = nn.Parameter(w.detach(), requires_grad=False)
        todo.append(head)  # a packed copy: a tied weight stays the embedding table too
        # kind "c": every packed weight a slice of one arena in huge pages (hugepages.empty leaves a
        # tensor under 4 MB in 4 KB pages: SmolLM2's q/k/v, o and down projections, 255 MB streamed a
        # step through ~62,000 pages). Each slice starts on a cache line.
        outs: list[torch.Tensor | None] = [None] * len(todo)
        if kind == "c":
            numels = [cpu_ops.gemm_packed_numel(m.out_features, m.in_features) for m in todo]
            spans = [-(-n // 16) * 16 for n in numels]  # whole cache lines
            arena = hugepages.empty((sum(spans) + 16,), dtype=torch.float32)
            start = (-(arena.data_ptr() // 4)) % 16  # to a 64-byte boundary
            for i, (n, span) in enumerate(zip(numels, spans)):
                outs[i] = arena[start:start + n]
                start += span
        for m, out in zip(todo, outs):
            m.prepack(kind, out=out)
        self.packed_lm_head = head
        if not self.shape.tie_word_embeddings:
            del self.lm_head
        self.fused_stack_blocker, self._stack = None, None
        return True

    def _fused_stack(self, kv_caches: Sequence[torch.Tensor], backend: AttentionBackend):
        """The one-call layer driver for these layers' KV caches (model/fused_stack.py), or None
        where this model, backend or build cannot use it (decided once; the table is built once
        per cache)."""
        if backend.name != "cpu" or kv_caches[0].device.type != "cpu" or kv_caches[0].shape[3] > 16:
            return None  # (blocks of more than 16 tokens: the C decode kernel's generic path)
        if self.fused_stack_blocker is None:
            from prefixkv.model import fused_stack

            self.fused_stack_blocker = fused_stack.blocker(self) or ""
        if self.fused_stack_blocker:
            return None
        if self._stack is None or self._stack.kv_caches is not kv_caches:
            from prefixkv.model.fused_stack import FusedStack

            self._stack = FusedStack(self, kv_caches)
        return self._stack

    def lm_head_weight(self) -> torch.Tensor:
        if self.shape.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    @property
    def greedy_head_ok(self) -> bool:
        """Whether ``forward(greedy=True)`` can take each row's argmax inside the C LM head (the C
        GEMM's packed head, the C norm; no final softcap, whose tanh could tie values)."""
        head = self.packed_lm_head
        return (head is not None and head.kind == "c" and self.model.norm.fused
                and self.shape.final_softcap is None and cpu_ops.gemm_available())

    def logits(self, h: torch.Tensor) -> torch.Tensor:  # h [S, hidden] -> [S, vocab]
        if self.packed_lm_head is not None:
            return self.packed_lm_head(h)
        return lm_head(h, self.lm_head_weight())

    def rope(self, positions: torch.Tensor, dtype: torch.dtype, kind: str = "default",
             max_position: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] of ``positions`` (as transformers computes them). On CPU, given
        ``max_position`` (above every position), rows of a table of positions 0 .. n - 1 made once
        by the same ops (elementwise, so each value is the same bits; tests/test_model.py):
        two index ops a step instead of nine, each costly when a step's weights have just streamed
        through the caches."""
        if max_position is None or positions.device.type != "cpu":
            return self._rope_compute(positions, dtype, kind)
        table = self._rope_tables.get((kind, dtype))
        have = 0 if table is None else table[0].shape[0]
        if have < max_position:  # the rows of the new positions appended (4,096 at a time)
            cos, sin = self._rope_compute(torch.arange(have, -(-max_position // 4096) * 4096), dtype, kind)
            table = self._rope_tables[(kind, dtype)] = (cos, sin) if table is None else (
                torch.cat((table[0], cos)), torch.cat((table[1], sin)))
        return table[0].index_select(0, positions), table[1].index_select(0, positions)

    def _rope_compute(self, positions: torch.Tensor, dtype: torch.dtype, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq, scaling = self.ropes[kind]
        freqs = positions[:, None].float() * inv_freq[None, :]  # [T, D/2] fp32
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: Sequence[torch.Tensor],  # per layer: [2, num_blocks + 1, KVH, block_size, D]
        metas: Sequence[AttentionMetadata],  # per layer: its KV cache group's metadata
        backend: AttentionBackend,
        logits_indices: torch.Tensor | None,  # [S] rows of the batch whose logits are needed (None: all, in order)
        greedy: bool = False,
    ) -> torch.Tensor:  # [S, vocab] float32 (float64 models: float64); greedy: [S] int64
        """Layer i reads and writes ``kv_caches[i]`` through ``metas[i]`` (the runner maps layers
        to KV cache groups: kv/groups.py; a whole cache tensor [num_layers, 2, ...] serves as the
        per-layer sequence too). ``greedy`` (where ``greedy_head_ok``): each row's argmax token
        instead of its logits, the logits never written (cpu_ops.lm_head_argmax: the same token as
        argmax of the logits returned otherwise)."""
        h = self.model.embed_tokens(input_ids)  # [T, hidden]
        if self.shape.gemma:  # sqrt(hidden) as a tensor of the model's dtype, as transformers'
            h = h * torch.tensor(self.shape.hidden_size ** 0.5, dtype=h.dtype)
        top = metas[0].max_seq_len  # above every position
        tables = {k: self.rope(positions, h.dtype, k, top) for k in self.ropes}  # [T, D] cos, sin each
        residual = None
        stack = self._fused_stack(kv_caches, backend)
        rows = stack.rows(metas[0], backend.batch_invariant) if stack is not None else None
        if rows is not None:  # every layer in one C call (model/fused_stack.py): the same bits
            h, residual = stack(h, *tables[self.layer_rope[0]], metas[0], *rows)
        else:
            for i, layer in enumerate(self.model.layers):
                cos, sin = tables[self.layer_rope[i]]
                h, residual = layer(h, residual, cos, sin, kv_caches[i], metas[i], backend)
        if logits_indices is not None:
            h, residual = h[logits_indices], residual[logits_indices]
        if greedy:
            assert self.greedy_head_ok
            head, norm = self.packed_lm_head, self.model.norm
            tokens = cpu_ops.lm_head_argmax(h, residual, norm._kernel_weight(), norm.eps, head.packed,
                                            head.out_features, head.bias)
            if tokens is not None:
                return tokens  # (None: its scratch could not be allocated; the logits below instead)
        h, _ = self.model.norm.add_forward(h, residual)  # [S, hidden]
        logits = self.logits(h)
        if self.shape.final_softcap is not None:
            cap = self.shape.final_softcap
            if self.model.norm.fused and logits.is_contiguous():  # element by element in C: row-invariant
                cpu_ops.softcap_(logits, cap)
            else:
                logits = torch.tanh(logits / cap) * cap
        if greedy:
            return logits.argmax(dim=-1)
        return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
