"""Sparse mixture-of-experts MLP blocks (Mixtral, Qwen3-MoE): a router picks the top-k experts of
each token, their SwiGLU outputs are summed with the routing weights. The torch path, mirroring
transformers' eager experts op for op:

    probs = softmax(router(x) in float32);  w, idx = topk(probs, k)  (renormalised: w / sum(w))
    for each expert e hit this step, in ascending id order:
        rows = the tokens that chose e (ordered by their top-k slot, then token)
        out[rows] += down_e(act(gate_e(x[rows])) * up_e(x[rows])) * w[rows, slot]

so each token's sum runs over its experts in expert-id order, as transformers' ``index_add_``.
Mixtral multiplies by the float32 weights (and casts the product); Qwen3-MoE casts the weights to
the model's dtype first. Experts load from per-expert checkpoint tensors (``experts.{e}.w1/w3/w2``,
``experts.{e}.gate_proj/up_proj/down_proj``) or fused ones (``experts.gate_up_proj`` [E, 2I, H],
``experts.down_proj`` [E, H, I]); see ``model/loader.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from prefixkv.model.linear import Linear


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, make_expert: Callable[[], nn.Module], num_experts: int, top_k: int,
                 renormalize: bool, weights_in_fp32: bool) -> None:
        """``make_expert``: one expert, the decoder's gated MLP (``model/llama.py``'s ``MLP``)."""
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"model: num_experts_per_tok must be from 1 to {num_experts}, got {top_k}")
        self.gate = Linear(hidden, num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(make_expert() for _ in range(num_experts))
        self.num_experts, self.top_k = num_experts, top_k
        self.renormalize = renormalize
        self.weights_in_fp32 = weights_in_fp32  # Mixtral: the product is taken with float32 weights

    @property
    def fused_act(self) -> bool:
        return self.experts[0].fused_act

    @fused_act.setter
    def fused_act(self, on: bool) -> None:
        for e in self.experts:
            e.fused_act = on

    def fuse(self) -> None:
        for e in self.experts:
            e.fuse()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) of each token, as transformers' routers compute them."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [T, E] float32
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.weights_in_fp32 else weights.to(x.dtype)), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = torch.zeros_like(x)
        # [E, k, T]: which (slot, token) chose each expert; experts in ascending id order
        chosen = F.one_hot(ids, self.num_experts).permute(2, 1, 0)
        for e in (chosen.sum(dim=(1, 2)) > 0).nonzero().flatten().tolist():
            slot, token = torch.where(chosen[e])
            y = self.experts[e](x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out
