"""Linear layers of the decoder: fused projections and, on CPU in float32, GEMMs on prepacked weights.

CPU float32 backends (``EngineConfig.cpu_linear``; ``resolve_cpu_linear`` picks for "auto"):

- "c": the engine's own GEMM (``gemm_f32`` in prefixkv/csrc/cpu_ops.c, AVX-512 or AVX2 + FMA):
  weights packed into panels (48 wide, 8 x 48 register tiles on AVX-512; 16 wide, 6 x 16 on AVX2),
  every output a sum of 64-wide FMA chains over k in order (float32 error below MKL's; the same
  bits on either build). On SmolLM2's projections (bench/RESULTS.md, 2026-12-01: `9f36fec`; for AVX2,
  `9ba041c`) a 16-row decode step's GEMMs take ~1.2x less time than oneDNN's on AVX-512
  and ~1.5x less on AVX2; prefill-sized GEMMs run about as fast as oneDNN's on AVX-512 (2,048 rows)
  and at ~0.9x on AVX2 (512 rows; 2026-12-02, `1ff7546`). Its rows are bitwise independent of the batch they run in,
  for every M including 1 (tests/test_linear.py).
- "onednn": see below; where the C kernel is not built (no AVX2 / AVX-512, or no compiler).
- "torch": ``F.linear`` (MKL), the plain path.

Why oneDNN on CPU: torch's ``F.linear`` calls MKL's sgemm, which on this project's machines (AMD
EPYC, AVX-512) runs a 16-row decode batch of SmolLM2's projections at ~12 GB/s of weights; oneDNN's
matmul on a weight reordered once into its blocked layout (``torch.ops.mkldnn``: the ops inductor's
weight-prepack pass emits) reaches ~27 GB/s, the machine's read bandwidth (bench/RESULTS.md, "CPU
GEMM"). Its results differ from MKL's in float32 rounding only (~1e-6 relative; tests/test_linear.py
compares them); from two rows up they are row-invariant here (a row's output does not depend on
how many rows the call has; tested). float64 (the exact lossless matrix) and other devices keep ``F.linear``.

Fusion: q/k/v and gate/up are one GEMM each over the concatenated weight (``FusedLinear``); each
output column is the same dot product it was in its own GEMM (tested bitwise for both backends).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from prefixkv import cpu_ops

# the batch-size hint oneDNN picks its weight layout for; measured as good from 1 to 512 rows
_PACK_ROWS_HINT = 16


CPU_LINEAR_CHOICES = ("auto", "c", "onednn", "torch")


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def resolve_cpu_linear(requested: str) -> str:
    """"auto" -> the C GEMM where built, else oneDNN, else torch; an explicit choice that this
    machine cannot run is a ValueError naming ``cpu_linear``."""
    available = {"c": cpu_ops.gemm_available(), "onednn": onednn_available(), "torch": True}
    if requested == "auto":
        return next(k for k in ("c", "onednn", "torch") if available[k])
    if requested not in available:
        raise ValueError(f"cpu_linear: must be one of {CPU_LINEAR_CHOICES}, got {requested!r}")
    if not available[requested]:
        raise ValueError(f"cpu_linear: {requested!r} is not available on this machine "
                         f"({'no AVX-512 or AVX2 build of the C kernels' if requested == 'c' else 'torch without oneDNN'})")
    return requested


class Linear(nn.Module):
    """``y = x @ weight.T + bias`` over x [T, in_features] -> [T, out_features].

    ``prepack(kind)`` (CPU, float32) replaces ``weight`` by its packed copy for the C GEMM
    (kind "c") or its oneDNN-blocked copy ("onednn"); the plain weight is dropped (the packed one
    is the only copy) and ``forward`` calls that GEMM.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None
        self.kind = "torch"

    def prepack(self, kind: str = "onednn", out: torch.Tensor | None = None) -> None:
        """``out`` (kind "c"): where to pack (``cpu_ops.gemm_pack``)."""
        assert kind in ("c", "onednn"), kind
        w = self.weight.detach().contiguous()
        if kind == "c":
            self.packed = cpu_ops.gemm_pack(w, out=out)
            self.c_gemm = cpu_ops.gemm_caller(self.packed, self.out_features, self.bias)
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS_HINT)
        self.kind = kind
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "c":
            return self.c_gemm(x if x.stride(-1) == 1 else x.contiguous())
        if self.kind == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class FusedLinear(Linear):
    """Several projections of the same input as one GEMM; ``forward`` returns the parts, in order.

    Built from the checkpoint's separate weights (``from_parts``), so parameter names of the
    checkpoint map onto slices of one weight: part ``i`` is rows ``offsets[i]:offsets[i+1]``."""

    def __init__(self, in_features: int, part_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(part_sizes), bias)
        self.part_sizes = list(part_sizes)

    @classmethod
    def from_parts(cls, parts: list[nn.Linear | Linear]) -> "FusedLinear":
        in_features = parts[0].weight.shape[1]
        has_bias = parts[0].bias is not None
        fused = cls(in_features, [p.weight.shape[0] for p in parts], has_bias)
        fused.weight = nn.Parameter(torch.cat([p.weight.detach() for p in parts]), requires_grad=False)
        if has_bias:
            fused.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=False)
        return fused

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        """The parts side by side: [T, sum(part_sizes)]."""
        return super().forward(x)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.whole(x).split(self.part_sizes, dim=-1)
