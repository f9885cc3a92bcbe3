"""CUDA backend: the paged-attention kernels in ``cuda/*.cu``, compiled at run time by CuPy (NVRTC).

This is the only module that imports cupy, and only inside functions: importing it needs neither
cupy nor a GPU. Kernels are compiled once per template instantiation (``functools.cache``; CuPy also
keeps the binaries on disk) and launched on torch's current stream on the ``data_ptr()`` of torch
tensors. Nothing here synchronizes with the host or allocates through CuPy, so a forward pass can be
captured in a CUDA graph -- after one eager warm-up step, because the first call of each kernel
compiles it. Under a graph, ``meta.max_seq_len`` / ``max_query_len`` size the grids: capture with
upper bounds (kernels exit early past each sequence's real lengths).

Plain functions for tests and benchmarks: ``write_kv``, ``paged_decode_attention``,
``paged_prefill_attention``, ``copy_blocks``. Each checks shapes, dtypes, strides and devices and
raises ``ValueError`` with the offending value.

Kernels (see the sources for layouts and launch configurations):

* ``paged_decode_kernel`` (+ ``paged_decode_reduce_kernel`` for split-K): one query token per sequence,
  one CTA per (sequence, kv head[, query-head chunk][, 512-token partition]).
* ``paged_prefill_mma_kernel`` (fp16/bf16, head_dim <= 128, sm_80+: tensor cores) and
  ``paged_prefill_kernel`` (SIMT fp32 math, any dtype): ragged query chunks with a cached prefix.
* ``write_kv_kernel``, ``copy_blocks_kernel``.

The attention kernels take a sliding ``window`` (a query at p sees keys p - window < j <= p;
keys before are never read, so a window's past blocks may hold anything) and a ``softcap``
(Gemma 2: scores -> softcap * tanh(score / softcap)), as arguments, not template parameters.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import numpy as np
import torch

from prefixkv.attention.base import AttentionBackend, AttentionMetadata, token_rows

CUDA_SOURCE_DIR = Path(__file__).resolve().parents[1] / "cuda"  # package data (prefixkv/cuda)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 128, 256)
_PREFILL_SIMT_MAX_ROW_BYTES = 512  # PrefillSimtConfig: head_dim * element size
DECODE_PARTITION_SIZE = 512  # DECODE_PARTITION_SIZE in cuda/paged_decode.cu
SPLIT_K_MIN_SEQ_LEN = 1024  # split-K only pays off for long contexts ...
SPLIT_K_MAX_WAVES = 2  # ... and when the plain grid fills fewer than this many waves of CTAs

_TYPE_NAMES = {torch.float16: "prefixkv::half_t", torch.bfloat16: "prefixkv::bf16_t", torch.float32: "float"}
_NVRTC_OPTIONS = ("-std=c++17",)
_DECODE_THREADS = 128  # DECODE_NUM_THREADS
_PREFILL_THREADS = 128  # PREFILL_NUM_THREADS
_CACHE_OPS_THREADS = 128  # CACHE_OPS_THREADS
_PREFILL_MMA_BLOCK_M = 64  # PREFILL_MMA_BLOCK_M
_MAX_GRID_YZ = 65535
_LOG2E = 1.4426950408889634


# ---- compilation and launch --------------------------------------------------------------------


@functools.cache
def _source(file_name: str) -> str:
    """``cuda/<file_name>`` with its ``#include "..."`` lines inlined, so CuPy's cache key sees them."""
    included: set[Path] = set()

    def expand(path: Path) -> str:
        lines = []
        for line in path.read_text().splitlines():
            if line.strip() == "#pragma once":
                continue
            m = re.match(r'\s*#include\s+"([^"]+)"', line)
            if m is None:
                lines.append(line)
                continue
            header = (path.parent / m.group(1)).resolve()
            if header not in included:
                included.add(header)
                lines.append(expand(header))
        return "\n".join(lines)

    path = CUDA_SOURCE_DIR / file_name
    if not path.is_file():
        raise FileNotFoundError(f"CUDA source {path} not found (prefixkv must run from a source checkout)")
    return expand(path)


def _cupy():
    try:
        import cupy
    except ImportError as e:  # the one optional dependency of the GPU path
        raise ImportError("the 'cuda' attention backend compiles its kernels through CuPy, which is not "
                          "importable here; install the wheel matching your CUDA (e.g. pip install "
                          "'prefixkv[cuda]' for cupy-cuda13x), or use attention_backend='torch'") from e
    return cupy


@functools.cache
def _kernel(file_name: str, name_expr: str, device_index: int):
    """Compiles (NVRTC; CuPy also caches the binary on disk) and loads one instantiation."""
    cupy = _cupy()
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=_source(file_name), options=_NVRTC_OPTIONS, name_expressions=(name_expr,))
        return module.get_function(name_expr)


def _launch(file_name: str, name_expr: str, grid: tuple[int, int, int], block: int, args: tuple,
            device: torch.device) -> None:
    """Launches ``name_expr`` from ``cuda/<file_name>`` on torch's current stream of ``device``.

    The stream is looked up at every launch (never cached): under ``torch.cuda.graph`` the current
    stream is the capture stream, and launching anywhere else would leave the kernel out of the graph.
    """
    cupy = _cupy()
    kernel = _kernel(file_name, name_expr, device.index)
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream, device.index)
    with cupy.cuda.Device(device.index):
        kernel(grid, (block, 1, 1), args, stream=stream)


@functools.cache
def _device_info(device_index: int) -> tuple[int, tuple[int, int]]:
    """(number of SMs, compute capability)."""
    props = torch.cuda.get_device_properties(device_index)
    return props.multi_processor_count, (props.major, props.minor)


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _i32(x: int) -> np.int32:
    return np.int32(x)


def _i64(x: int) -> np.int64:
    return np.int64(x)


# ---- kernel names (CuPy name expressions: one compiled instantiation each) ----------------------


def _cache_op_name(kernel: str, dtype: torch.dtype) -> str:
    return f"prefixkv::{kernel}<{_TYPE_NAMES[dtype]}>"


def _decode_name(dtype: torch.dtype, head_dim: int, block_size: int, group: int, split_k: bool) -> str:
    return (f"prefixkv::paged_decode_kernel<{_TYPE_NAMES[dtype]}, {head_dim}, {block_size}, {group}, "
            f"{'true' if split_k else 'false'}>")


def _decode_reduce_name(dtype: torch.dtype, head_dim: int) -> str:
    return f"prefixkv::paged_decode_reduce_kernel<{_TYPE_NAMES[dtype]}, {head_dim}>"


def _prefill_name(impl: str, dtype: torch.dtype, head_dim: int, block_size: int) -> str:
    kernel = "paged_prefill_mma_kernel" if impl == "mma" else "paged_prefill_kernel"
    return f"prefixkv::{kernel}<{_TYPE_NAMES[dtype]}, {head_dim}, {block_size}>"


def name_expressions(dtype: torch.dtype, head_dim: int, block_size: int, queries_per_kv: int,
                     mma: bool = True) -> dict[str, list[str]]:
    """Every kernel instantiation a model of this shape can launch, by source file (for offline
    compile checks; at run time each is compiled on first use)."""
    group = _decode_group(queries_per_kv)
    prefill = [_prefill_name("simt", dtype, head_dim, block_size)]
    if mma and _mma_supported(dtype, head_dim):
        prefill.append(_prefill_name("mma", dtype, head_dim, block_size))
    return {
        "cache_ops.cu": [_cache_op_name(k, dtype) for k in ("write_kv_kernel", "copy_blocks_kernel")],
        "paged_decode.cu": [_decode_name(dtype, head_dim, block_size, group, split) for split in (False, True)]
        + [_decode_reduce_name(dtype, head_dim)],
        "paged_prefill.cu": prefill,
    }


def unsupported_reason(dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int) -> str | None:
    """Why the kernels cannot serve a model of this shape (None: they can), for the engine to decide
    at configuration rather than at the first step: the dtype, the head_dim, the GQA ratio, and the
    SIMT prefill kernel's 512-byte rows (the only prefill kernel for float32 and head_dim > 128)."""
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} (the kernels take {', '.join(map(str, SUPPORTED_DTYPES))})"
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {head_dim} (the kernels take {', '.join(map(str, SUPPORTED_HEAD_DIMS))})"
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        return f"num_heads {num_heads} with num_kv_heads {num_kv_heads} (not a whole GQA group)"
    row_bytes = head_dim * torch.finfo(dtype).bits // 8
    if not _mma_supported(dtype, head_dim) and row_bytes > _PREFILL_SIMT_MAX_ROW_BYTES:
        return f"head_dim {head_dim} in {dtype} (the prefill kernel's rows hold {_PREFILL_SIMT_MAX_ROW_BYTES} bytes)"
    return None


# ---- argument checks ---------------------------------------------------------------------------


def _require_cuda(t: torch.Tensor, name: str) -> None:
    if not t.is_cuda:
        raise ValueError(f"{name}: must be a CUDA tensor, got device {t.device}")


def _check_cache_layer(kv_cache_layer: torch.Tensor) -> None:
    c = kv_cache_layer
    if c.dim() != 5 or c.shape[0] != 2:
        raise ValueError("kv_cache_layer: expected [2, num_blocks + 1, num_kv_heads, block_size, head_dim], "
                         f"got {tuple(c.shape)}")
    _require_cuda(c, "kv_cache_layer")
    if c.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"kv_cache_layer: dtype {c.dtype} not supported (one of {SUPPORTED_DTYPES})")
    if c.shape[4] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"kv_cache_layer: head_dim {c.shape[4]} not supported (one of {SUPPORTED_HEAD_DIMS})")
    if not c.is_contiguous():
        raise ValueError(f"kv_cache_layer: must be contiguous, got strides {c.stride()}")
    if c.data_ptr() % 16:
        raise ValueError("kv_cache_layer: data must be 16-byte aligned")


def _check_rows(name: str, t: torch.Tensor, num_heads: int | None, cache: torch.Tensor) -> None:
    """``t`` is [num_tokens, num_heads, head_dim] of the cache's dtype/device/head_dim, with
    contiguous heads and 16-byte aligned token rows (the token stride may exceed num_heads*head_dim,
    e.g. a slice of a fused qkv projection)."""
    head_dim = cache.shape[4]
    if t.dim() != 3 or t.shape[2] != head_dim or (num_heads is not None and t.shape[1] != num_heads):
        heads = "num_heads" if num_heads is None else f"num_heads={num_heads}"
        raise ValueError(f"{name}: expected [num_tokens, {heads}, head_dim={head_dim}] (the cache's "
                         f"head_dim), got {tuple(t.shape)}")
    if t.dtype != cache.dtype:
        raise ValueError(f"{name}: dtype {t.dtype} differs from the cache's {cache.dtype}")
    if t.device != cache.device:
        raise ValueError(f"{name}: device {t.device} differs from the cache's {cache.device}")
    if t.stride(2) != 1 or (t.shape[1] > 1 and t.stride(1) != head_dim):
        raise ValueError(f"{name}: heads and head_dim must be contiguous, got strides {t.stride()}")
    if t.data_ptr() % 16 or (t.shape[0] > 1 and (t.stride(0) * t.element_size()) % 16):
        raise ValueError(f"{name}: token rows must be 16-byte aligned (data_ptr {t.data_ptr():#x}, "
                         f"strides {t.stride()})")


def _check_index(name: str, t: torch.Tensor, dtype: torch.dtype, dim: int, device: torch.device,
                 min_rows: int | None = None) -> None:
    if t.dtype != dtype or t.dim() != dim:
        raise ValueError(f"{name}: expected a {dim}-D {dtype} tensor, got {t.dim()}-D {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name}: device {t.device} differs from the cache's {device}")
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name}: last dimension must be contiguous, got strides {t.stride()}")
    if min_rows is not None and t.shape[0] < min_rows:
        raise ValueError(f"{name}: expected at least {min_rows} rows, got shape {tuple(t.shape)}")


def _out_like(q: torch.Tensor, out: torch.Tensor | None, cache: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _check_rows("out", out, q.shape[1], cache)
    if out.shape[0] < q.shape[0]:
        raise ValueError(f"out: expected at least {q.shape[0]} rows, got {tuple(out.shape)}")
    return out


def _gqa(num_heads: int, cache: torch.Tensor) -> int:
    num_kv_heads = cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    return num_heads // num_kv_heads


# ---- KV write and block copy -------------------------------------------------------------------


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache_layer: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes ``k``, ``v`` [num_tokens, num_kv_heads, head_dim] into the layer's cache at
    ``slot_mapping`` [num_tokens] int64 (slot = block_id * block_size + offset). Negative slots and
    slots past the cache are skipped."""
    _check_cache_layer(kv_cache_layer)
    _, num_blocks_total, num_kv_heads, block_size, head_dim = kv_cache_layer.shape
    _check_rows("k", k, num_kv_heads, kv_cache_layer)
    _check_rows("v", v, num_kv_heads, kv_cache_layer)
    num_tokens = k.shape[0]
    if v.shape[0] != num_tokens:
        raise ValueError(f"k and v: different numbers of tokens ({num_tokens} vs {v.shape[0]})")
    _check_index("slot_mapping", slot_mapping, torch.int64, 1, kv_cache_layer.device, num_tokens)
    if num_tokens == 0:
        return
    args = (_ptr(kv_cache_layer), _ptr(kv_cache_layer[1]), _ptr(k), _ptr(v), _ptr(slot_mapping),
            _i32(num_kv_heads), _i32(head_dim), _i32(block_size), _i64(num_blocks_total * block_size),
            _i64(k.stride(0)), _i64(v.stride(0)))
    name = _cache_op_name("write_kv_kernel", k.dtype)
    _launch("cache_ops.cu", name, (num_tokens, 1, 1), _CACHE_OPS_THREADS, args, kv_cache_layer.device)


def copy_blocks(kv_cache: torch.Tensor, src_dst: torch.Tensor) -> None:
    """Copies whole blocks in every layer (K and V) in one launch, one CTA per (pair, layer plane).
    ``kv_cache`` is [num_layers, 2, num_blocks + 1, num_kv_heads, block_size, head_dim], contiguous
    (the kernel addresses every layer plane from one base); ``src_dst`` is [num_copies, 2] int64
    (src, dst) block ids, checked on the host (a CUDA tensor is copied there first). The copies run
    at once, so no block may be the dst of two pairs or both a dst and a src (ValueError). Pairs
    naming a block outside the cache are skipped."""
    if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
        raise ValueError("kv_cache: expected [num_layers, 2, num_blocks + 1, num_kv_heads, block_size, head_dim], "
                         f"got {tuple(kv_cache.shape)}")
    _check_cache_layer(kv_cache[0])
    if not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache: must be contiguous (every layer is addressed from one base), got strides "
                         f"{kv_cache.stride()} for shape {tuple(kv_cache.shape)}")
    if src_dst.dim() != 2 or src_dst.shape[1] != 2 or src_dst.dtype != torch.int64:
        raise ValueError(f"src_dst: expected [num_copies, 2] int64, got {tuple(src_dst.shape)} {src_dst.dtype}")
    num_copies = src_dst.shape[0]
    if num_copies == 0:
        return
    num_layers, _, num_blocks_total, num_kv_heads, block_size, head_dim = kv_cache.shape
    _check_copy_pairs(src_dst.cpu().tolist(), num_blocks_total)
    src_dst = src_dst.to(kv_cache.device).contiguous()
    if 2 * num_layers > _MAX_GRID_YZ:
        raise ValueError(f"kv_cache: too many layers ({num_layers})")
    args = (_ptr(kv_cache), _ptr(src_dst), _i64(num_blocks_total), _i64(num_kv_heads * block_size * head_dim))
    name = _cache_op_name("copy_blocks_kernel", kv_cache.dtype)
    _launch("cache_ops.cu", name, (num_copies, 2 * num_layers, 1), _CACHE_OPS_THREADS, args, kv_cache.device)


def _check_copy_pairs(pairs: list[list[int]], num_blocks_total: int) -> None:
    """The pairs copy_blocks_kernel runs at once must not race: each dst once, and no dst a src."""
    valid = [(s, d) for s, d in pairs if 0 <= s < num_blocks_total and 0 <= d < num_blocks_total]
    srcs = {s for s, _ in valid}
    dsts: set[int] = set()
    for s, d in valid:
        if d in dsts:
            raise ValueError(f"src_dst: block {d} is the destination of two copies")
        if d in srcs:
            raise ValueError(f"src_dst: block {d} is both a destination and a source")
        dsts.add(d)


# ---- decode ------------------------------------------------------------------------------------


def padded_decode_batch(num_seqs: int) -> int:
    """``num_seqs`` decodes rounded up to 1, 2, 4, 8 or a multiple of 8. Every CUDA-graph bucket
    (runner/cuda_graph.decode_buckets) lies within one such class, so a batch and the bucket it is
    padded to round to the same size."""
    if num_seqs <= 2:
        return num_seqs
    if num_seqs <= 8:
        return 4 if num_seqs <= 4 else 8
    return -(-num_seqs // 8) * 8


def decode_split_k(num_seqs: int, num_kv_heads: int, queries_per_kv: int, max_seq_len: int, num_sms: int) -> bool:
    """Whether a decode batch runs split-K: a long context bound (``max_seq_len`` >
    SPLIT_K_MIN_SEQ_LEN) and a plain grid of fewer than SPLIT_K_MAX_WAVES waves of CTAs. The grid is
    counted for the batch rounded as ``padded_decode_batch`` rounds it, so the same rows decide
    alike eagerly and in the CUDA graph of the bucket they are padded to (its padding rows
    included): a batch's arithmetic does not depend on whether it fits a graph."""
    num_ctas = padded_decode_batch(num_seqs) * num_kv_heads * -(-queries_per_kv // _decode_group(queries_per_kv))
    return max_seq_len > SPLIT_K_MIN_SEQ_LEN and num_ctas < SPLIT_K_MAX_WAVES * num_sms


def split_k_scratch_bytes(num_seqs: int, num_heads: int, head_dim: int, max_seq_len: int) -> int:
    """Bytes of one split-K launch's scratch (``_split_k_scratch``): per (sequence, head, 512-token
    partition of max_seq_len) a max, a sum and a head_dim-float partial output."""
    return num_seqs * num_heads * max(1, -(-max_seq_len // DECODE_PARTITION_SIZE)) * (head_dim + 2) * 4


def _split_k_scratch(num_seqs: int, num_heads: int, num_parts: int, head_dim: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(part_max, part_sum [num_seqs, num_heads, num_parts], part_out [..., head_dim]), float32. Freed
    after the layer's reduce, so one layer's worth is live at a time (in a graph's pool too)."""
    part_max = torch.empty((num_seqs, num_heads, num_parts), dtype=torch.float32, device=device)
    part_out = torch.empty((num_seqs, num_heads, num_parts, head_dim), dtype=torch.float32, device=device)
    return part_max, torch.empty_like(part_max), part_out


def _decode_group(queries_per_kv: int) -> int:
    """Query heads per decode CTA (template GROUP, <= 8): the whole GQA group when it fits, else
    the largest divisor in [4, 8], else 8 (the last chunk then runs partly empty)."""
    if queries_per_kv <= 8:
        return queries_per_kv
    for group in (8, 7, 6, 5, 4):
        if queries_per_kv % group == 0:
            return group
    return 8


def _window_softcap(window: int | None, softcap: float | None) -> tuple[np.int32, np.float32]:
    """The kernels' window (0: none) and soft-cap in log2 units (0: none) arguments."""
    if window is not None and window < 1:
        raise ValueError(f"window: must be >= 1, got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap: must be > 0, got {softcap}")
    return _i32(window or 0), np.float32(softcap * _LOG2E if softcap else 0.0)


def _decode(out: torch.Tensor, q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
            seq_lens: torch.Tensor, num_seqs: int, scale: float, max_seq_len: int,
            split_k: bool | None, window: int | None = None, softcap: float | None = None) -> None:
    """Decode attention for sequences 0 .. num_seqs-1, whose query is row s of ``q``."""
    win, cap = _window_softcap(window, softcap)
    _, _, num_kv_heads, block_size, head_dim = cache.shape
    num_heads = q.shape[1]
    queries_per_kv = _gqa(num_heads, cache)
    group = _decode_group(queries_per_kv)
    num_chunks = -(-queries_per_kv // group)
    if num_seqs > _MAX_GRID_YZ:
        raise ValueError(f"too many decode sequences for one launch ({num_seqs} > {_MAX_GRID_YZ})")
    if split_k is None:
        split_k = decode_split_k(num_seqs, num_kv_heads, queries_per_kv, max_seq_len,
                                 _device_info(cache.device.index)[0])
    num_parts = max(1, -(-max_seq_len // DECODE_PARTITION_SIZE)) if split_k else 1
    if num_parts > _MAX_GRID_YZ:
        raise ValueError(f"max_seq_len {max_seq_len} too long for split-K")
    name = _decode_name(q.dtype, head_dim, block_size, group, split_k)
    part_max = part_sum = part_out = None
    if split_k:
        part_max, part_sum, part_out = _split_k_scratch(num_seqs, num_heads, num_parts, head_dim, q.device)
    args = (_ptr(out), _ptr(part_max), _ptr(part_sum), _ptr(part_out), _ptr(q), _ptr(cache), _ptr(cache[1]),
            _ptr(block_tables), _ptr(seq_lens), _i32(num_heads), _i32(num_kv_heads), _i32(block_tables.stride(0)),
            _i32(num_parts), _i64(q.stride(0)), _i64(out.stride(0)), np.float32(scale * _LOG2E), win, cap)
    grid = (num_kv_heads * num_chunks, num_seqs, num_parts)
    _launch("paged_decode.cu", name, grid, _DECODE_THREADS, args, cache.device)
    if split_k:
        args = (_ptr(out), _ptr(part_max), _ptr(part_sum), _ptr(part_out), _ptr(seq_lens), _i32(num_heads),
                _i32(num_parts), _i64(out.stride(0)), win)
        name = _decode_reduce_name(q.dtype, head_dim)
        _launch("paged_decode.cu", name, (num_heads, num_seqs, 1), -(-head_dim // 32) * 32, args, cache.device)


def paged_decode_attention(q: torch.Tensor, kv_cache_layer: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, max_seq_len: int, *,
                           out: torch.Tensor | None = None, split_k: bool | None = None,
                           window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Attention of one query token per sequence against its whole context (``window``: only its
    last ``window`` tokens; ``softcap``: scores capped to softcap * tanh(score / softcap)).

    q: [num_seqs, num_heads, head_dim]; block_tables: [num_seqs, max_blocks_per_seq] int32;
    seq_lens: [num_seqs] int32 (context incl. the query token, already in the cache);
    max_seq_len: an upper bound of seq_lens (sizes the split-K grid; a row longer than it comes out
    NaN under split-K: the bound is not checked here, which would need the lengths on the host).
    ``split_k`` None picks split-K for long contexts with few CTAs. Returns [num_seqs, num_heads, head_dim].
    """
    _check_cache_layer(kv_cache_layer)
    _check_rows("q", q, None, kv_cache_layer)
    num_seqs = q.shape[0]
    _check_index("block_tables", block_tables, torch.int32, 2, q.device, num_seqs)
    _check_index("seq_lens", seq_lens, torch.int32, 1, q.device, num_seqs)
    out = _out_like(q, out, kv_cache_layer)
    if num_seqs > 0:
        _decode(out, q, kv_cache_layer, block_tables, seq_lens, num_seqs, scale, max_seq_len, split_k,
                window, softcap)
    return out


# ---- prefill -----------------------------------------------------------------------------------


def _mma_supported(dtype: torch.dtype, head_dim: int) -> bool:
    """The tensor-core prefill kernel's static_asserts: fp16 / bf16, head_dim a multiple of 16 <= 128."""
    return dtype in (torch.float16, torch.bfloat16) and head_dim <= 128 and head_dim % 16 == 0


def _prefill_impl(dtype: torch.dtype, head_dim: int, device: torch.device, impl: str) -> str:
    if impl not in ("auto", "mma", "simt"):
        raise ValueError(f"impl: expected 'auto', 'mma' or 'simt', got {impl!r}")
    mma_ok = _mma_supported(dtype, head_dim)
    if impl == "mma" and not mma_ok:
        raise ValueError(f"impl 'mma' needs fp16/bf16 and head_dim <= 128 (got {dtype}, {head_dim})")
    if impl == "auto":
        impl = "mma" if mma_ok and _device_info(device.index)[1] >= (8, 0) else "simt"
    if impl == "simt" and head_dim * torch.finfo(dtype).bits // 8 > _PREFILL_SIMT_MAX_ROW_BYTES:
        raise ValueError(f"prefill: head_dim {head_dim} with {dtype} is not supported (row > 512 bytes)")
    return impl


def _prefill_block_m(impl: str, dtype: torch.dtype, head_dim: int) -> int:
    if impl == "mma":
        return _PREFILL_MMA_BLOCK_M
    return 32 if head_dim * torch.finfo(dtype).bits // 8 > 256 else 64  # PrefillSimtConfig::BLOCK_M


def _prefill(out: torch.Tensor, q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
             seq_lens: torch.Tensor, query_start_loc: torch.Tensor, first_seq: int, num_seqs: int,
             scale: float, max_query_len: int, impl: str, window: int | None = None,
             softcap: float | None = None) -> None:
    """Prefill attention for sequences first_seq .. num_seqs-1 (rows of q via query_start_loc)."""
    win, cap = _window_softcap(window, softcap)
    _, _, num_kv_heads, block_size, head_dim = cache.shape
    num_heads = q.shape[1]
    queries_per_kv = _gqa(num_heads, cache)
    num_prefill = num_seqs - first_seq
    if num_prefill <= 0 or max_query_len <= 0:
        return
    if num_prefill > _MAX_GRID_YZ:
        raise ValueError(f"too many prefill sequences for one launch ({num_prefill} > {_MAX_GRID_YZ})")
    impl = _prefill_impl(q.dtype, head_dim, q.device, impl)
    block_m = _prefill_block_m(impl, q.dtype, head_dim)
    heads_per_cta = min(queries_per_kv, block_m)
    num_chunks = -(-queries_per_kv // heads_per_cta)
    tokens_per_cta = block_m // heads_per_cta
    grid = (-(-max_query_len // tokens_per_cta), num_kv_heads * num_chunks, num_prefill)
    name = _prefill_name(impl, q.dtype, head_dim, block_size)
    args = (_ptr(out), _ptr(q), _ptr(cache), _ptr(cache[1]), _ptr(block_tables), _ptr(seq_lens),
            _ptr(query_start_loc), _i32(first_seq), _i32(num_heads), _i32(num_kv_heads),
            _i32(block_tables.stride(0)), _i32(heads_per_cta), _i64(q.stride(0)), _i64(out.stride(0)),
            np.float32(scale * _LOG2E), win, cap)
    _launch("paged_prefill.cu", name, grid, _PREFILL_THREADS, args, cache.device)


def paged_prefill_attention(q: torch.Tensor, kv_cache_layer: torch.Tensor, block_tables: torch.Tensor,
                            seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                            max_query_len: int, *, first_seq: int = 0, out: torch.Tensor | None = None,
                            impl: str = "auto", window: int | None = None,
                            softcap: float | None = None) -> torch.Tensor:
    """Causal attention of ragged query chunks against their sequences' cached context.

    q: [num_tokens, num_heads, head_dim], sequence s owning rows query_start_loc[s] ..
    query_start_loc[s+1]-1 (its last query_len tokens; their K/V already in the cache);
    query_start_loc: [num_seqs + 1] int32; seq_lens: [num_seqs] int32; block_tables:
    [num_seqs, max_blocks_per_seq] int32; max_query_len: an upper bound of the query lengths.
    Only sequences first_seq.. are computed (rows of earlier ones in ``out`` are untouched).
    ``impl``: "auto" (tensor cores for fp16/bf16 with head_dim <= 128 on sm_80+), "mma" or "simt".
    Returns out [num_tokens, num_heads, head_dim].
    """
    _check_cache_layer(kv_cache_layer)
    _check_rows("q", q, None, kv_cache_layer)
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    _check_index("seq_lens", seq_lens, torch.int32, 1, q.device)
    _check_index("query_start_loc", query_start_loc, torch.int32, 1, q.device, num_seqs + 1)
    _check_index("block_tables", block_tables, torch.int32, 2, q.device, num_seqs)
    if not 0 <= first_seq <= num_seqs:
        raise ValueError(f"first_seq {first_seq} outside [0, {num_seqs}]")
    out = _out_like(q, out, kv_cache_layer)
    _prefill(out, q, kv_cache_layer, block_tables, seq_lens, query_start_loc, first_seq, num_seqs, scale,
             max_query_len, impl, window, softcap)
    return out


# ---- backend -----------------------------------------------------------------------------------


def _check_meta(meta: AttentionMetadata, num_tokens: int, device: torch.device) -> None:
    num_seqs = meta.num_seqs
    num_decodes = meta.num_decode_seqs
    if not 0 <= num_decodes <= num_seqs or num_tokens < num_decodes:
        raise ValueError(f"num_decode_seqs {num_decodes} inconsistent with {num_seqs} sequences, "
                         f"{num_tokens} tokens")
    _check_index("seq_lens", meta.seq_lens, torch.int32, 1, device)
    _check_index("query_start_loc", meta.query_start_loc, torch.int32, 1, device, num_seqs + 1)
    _check_index("block_tables", meta.block_tables, torch.int32, 2, device, num_seqs)
    check_grid_bounds(meta)


def check_grid_bounds(meta: AttentionMetadata) -> None:
    """``meta.max_seq_len`` / ``max_query_len`` size the kernels' grids (split-K partitions, query
    tiles): a sequence longer than them would lose its tail without a word. Checked against the
    host copies of the lengths where the metadata has them (the runner's always does); without
    them, a split-K row past max_seq_len comes out NaN."""
    if meta.seq_lens_cpu:
        longest = max(meta.seq_lens_cpu)
        if longest > meta.max_seq_len:
            raise ValueError(f"max_seq_len: {meta.max_seq_len} is below sequence "
                             f"{meta.seq_lens_cpu.index(longest)}'s length {longest}")
    qsl = meta.query_start_loc_cpu
    if qsl:
        longest = max(b - a for a, b in zip(qsl, qsl[1:])) if len(qsl) > 1 else 0
        if longest > meta.max_query_len:
            raise ValueError(f"max_query_len: {meta.max_query_len} is below a sequence's {longest} query tokens")


class CudaAttentionBackend(AttentionBackend):
    """The CUDA kernels behind the ``AttentionBackend`` contract (see base.py).

    Decodes (the first ``meta.num_decode_seqs`` sequences, one token each) go to the decode kernel,
    split-K when ``meta.max_seq_len`` > SPLIT_K_MIN_SEQ_LEN and the plain grid is small
    (``decode_split_k``: the same choice for a batch eagerly and padded to its graph bucket); the
    rest to the prefill kernel. Rows of ``out`` past ``query_start_loc[num_seqs]`` (padding) are not written.
    """

    name = "cuda"

    def __init__(self, prefill_impl: str = "auto", split_k: bool | None = None,
                 batch_invariant: bool = False) -> None:
        self.prefill_impl = prefill_impl
        self.split_k = split_k
        # Invariant attention (issue 14): every query token, decode or prefill, runs the split-K
        # decode kernel with its own context length. Split-K is always on, by a fixed partition of
        # DECODE_PARTITION_SIZE tokens (never chosen by batch size or SM count); in a partition the
        # warps take 32-token chunks in a fixed order and merge in a fixed order, and the reduce
        # kernel merges a sequence's own partitions in order. A query's output is then bitwise the
        # same whatever the batch, the chunking of its prompt or the grid size (tested in the
        # emulator). The GEMMs (cuBLAS) are not invariant, so the engine does not offer the mode
        # on CUDA yet; this is its attention half.
        self.batch_invariant = batch_invariant

    def forward(self, q, k, v, kv_cache_layer, meta: AttentionMetadata, scale: float,
                window: int | None = None, softcap: float | None = None):
        _check_rows("q", q, None, kv_cache_layer)
        if q.shape[0] != k.shape[0]:
            raise ValueError(f"q and k: different numbers of tokens ({q.shape[0]} vs {k.shape[0]})")
        if "cuda_meta_checked" not in meta.scratch:  # the same for every layer of the step: check once
            _check_meta(meta, q.shape[0], q.device)
            meta.scratch["cuda_meta_checked"] = True
        write_kv(k, v, kv_cache_layer, meta.slot_mapping)
        if self.batch_invariant:
            return paged_attention_per_token(q, kv_cache_layer, meta, scale, window=window, softcap=softcap)
        num_seqs = meta.num_seqs
        num_decodes = meta.num_decode_seqs
        out = _out_like(q, None, kv_cache_layer)
        if num_decodes > 0:
            _decode(out, q, kv_cache_layer, meta.block_tables, meta.seq_lens, num_decodes, scale,
                    meta.max_seq_len, self.split_k, window, softcap)
        if num_seqs > num_decodes:
            _prefill(out, q, kv_cache_layer, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                     num_decodes, num_seqs, scale, meta.max_query_len, self.prefill_impl, window, softcap)
        return out

    def copy_blocks(self, kv_cache: torch.Tensor, src_dst: torch.Tensor) -> None:
        copy_blocks(kv_cache, src_dst)


def paged_attention_per_token(q: torch.Tensor, kv_cache_layer: torch.Tensor, meta: AttentionMetadata,
                              scale: float, out: torch.Tensor | None = None, window: int | None = None,
                              softcap: float | None = None) -> torch.Tensor:
    """The batch-invariant attention (CudaAttentionBackend(batch_invariant=True)): every query
    token of ``meta`` (decodes and prefill chunks alike) through the split-K decode kernel with its
    own context length. The K/V of the step must already be in the cache."""
    check_grid_bounds(meta)
    tables, lens = token_rows(meta)
    out = _out_like(q, out, kv_cache_layer)
    if lens.shape[0]:
        _decode(out, q, kv_cache_layer, tables, lens, lens.shape[0], scale, meta.max_seq_len, split_k=True,
                window=window, softcap=softcap)
    return out
