"""Attention backends over the one paged KV layout (see ``base``), chosen through a small registry
with lazy imports: ``torch`` (reference, CPU and GPU), ``cpu`` (the torch path with C decode
kernels; the CPU default) and ``cuda`` (raw CUDA kernels via CuPy)."""

from __future__ import annotations

import importlib

from prefixkv.attention.base import AttentionBackend, AttentionMetadata, kv_cache_shape

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


__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend", "kv_cache_shape"]
