"""Attention backends over the one paged KV layout (see ``base``), chosen through a small registry
with lazy imports: ``torch`` (reference, CPU and GPU), ``cpu`` (the torch path with C decode
kernels; the CPU default) and ``cuda`` (raw CUDA kernels via CuPy)."""

from __future__ import annotations

import importlib
import logging

import torch

from prefixkv.attention.base import AttentionBackend, AttentionMetadata, kv_cache_shape

logger = logging.getLogger(__name__)

_REGISTRY = {
    "torch": ("prefixkv.attention.torch_ref", "TorchAttentionBackend"),
    "cpu": ("prefixkv.attention.cpu", "CpuAttentionBackend"),
    "cuda": ("prefixkv.attention.cuda", "CudaAttentionBackend"),
}


def get_backend(name: str) -> AttentionBackend:
    if name not in _REGISTRY:
        raise ValueError(f"attention_backend: unknown backend {name!r} (choose from {', '.join(_REGISTRY)})")
    module, cls = _REGISTRY[name]
    return getattr(importlib.import_module(module), cls)()


def backend_for(name: str | None, device: str, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                head_dim: int) -> AttentionBackend:
    """The backend ``name`` for a model of this shape, or the device's default (None: "cpu" on CPU,
    "cuda" elsewhere). The CUDA kernels' limits are checked here, at configuration, not at the
    first step: a shape they do not take is refused (ValueError) when "cuda" was asked for, and
    runs on the "torch" backend, the reason logged, when "cuda" was the default. On a CUDA device
    the kernels' compiler (CuPy) must import."""
    chosen = name or ("cpu" if device == "cpu" else "cuda")
    if chosen == "cuda":
        from prefixkv.attention import cuda

        why = cuda.unsupported_reason(dtype, head_dim, num_heads, num_kv_heads)
        if why is not None and name is not None:
            raise ValueError(f"attention_backend: the 'cuda' kernels do not take this model's {why}; "
                             "attention_backend 'torch' does")
        if why is not None:
            logger.warning("attention_backend: the CUDA kernels do not take this model's %s; using the "
                           "'torch' backend", why)
            chosen = "torch"
        elif device == "cuda":
            cuda._cupy()
    return get_backend(chosen)


__all__ = ["AttentionBackend", "AttentionMetadata", "backend_for", "get_backend", "kv_cache_shape"]
