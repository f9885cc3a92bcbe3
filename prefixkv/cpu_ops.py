"""The C kernels of ``prefixkv/csrc/cpu_ops.c``: built once per machine, called through ctypes.

``load()`` compiles the source with the system C compiler (``$CC`` or ``cc``; ``-O3 -march=native
-fopenmp``; ``PREFIXKV_CPU_KERNELS=avx2`` adds ``-mno-avx512f``: the AVX2 kernels on an AVX-512
machine, which is how the tests check both builds there) into the prefixkv cache directory, keyed
by a hash of the source, the flags, the compiler's version and this CPU's feature flags, written to
a temporary file and renamed (a concurrent start-up finds either nothing or a whole library). It
returns None where no compiler works; the callers then keep the torch path.

The functions take raw pointers: the wrappers check dtype, device, contiguity and shapes first,
because the C side trusts them.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from prefixkv import hugepages
from prefixkv.cache_dir import cache_root
from prefixkv.progress import Task

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_ops.c"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11", "-ffp-contract=off",
          "-fno-trapping-math")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def _flags() -> tuple[str, ...]:
    return CFLAGS + (("-mno-avx512f",) if os.environ.get("PREFIXKV_CPU_KERNELS") == "avx2" else ())


def _build(cc: str, source: Path = SOURCE) -> Path:
    src = source.read_bytes()
    flags = _flags()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(b"\0".join([src, " ".join(flags).encode(), version.encode(),
                                     _cpu_flags().encode()])).hexdigest()[:16]
    out = cache_root() / "kernels" / f"cpu_ops-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".cpu_ops-", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        with Task(f"building the CPU kernels ({source.name}, once per machine)"):
            res = subprocess.run([cc, *flags, "-o", tmp, str(source), "-lm"], capture_output=True, text=True,
                                 timeout=300)
        if res.returncode != 0:
            raise RuntimeError(f"{cc} failed: {res.stderr.strip()[:2000]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel library, or None (no working C compiler, or ``PREFIXKV_CPU_KERNELS=0``)."""
    if os.environ.get("PREFIXKV_CPU_KERNELS", "1") == "0":
        return None
    cc = _compiler()
    if cc is None:
        return None
    try:
        return _open(_build(cc))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        print(f"prefixkv: CPU kernels unavailable ({e}); using the torch attention path", file=sys.stderr)
        return None


def load_source(source: Path) -> ctypes.CDLL:
    """Another version of the kernel source (same entry points), built and opened as ``load()``
    does its own, for A/B benchmarks (``python -m bench gemm --c-baseline``); errors raise."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler ($CC, cc or gcc)")
    return _open(_build(cc, Path(source)))


def takes_order(lib: ctypes.CDLL) -> bool:
    """Whether ``lib``'s decode kernels take a row order (``paged_decode_attention``'s ``order``): an
    older cpu_ops.c that ``bench kernel-ab`` builds as its baseline takes none."""
    return hasattr(lib, "paged_decode_takes_order")


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    order = [p] if takes_order(lib) else []
    for suffix, scalar in (("f32", ctypes.c_float), ("f64", ctypes.c_double)):
        fn = getattr(lib, f"paged_decode_attention_{suffix}")
        fn.argtypes = [p, i64, p, p, p, *order, p, i32, i32, i32, i32, i32, i32, i64, scalar, i32, scalar]
        fn.restype = None
    lib.paged_prefill_attention_f32.argtypes = [p, i64, p, p, p, p, p, i32, i32, i32, i32, i32, i32, i64,
                                                ctypes.c_float, i32, ctypes.c_float]
    lib.paged_prefill_attention_f32.restype = i32
    lib.add_rmsnorm_f32.argtypes = [p, i64, p, i64, p, i64, p, p, i64, i32, i32, ctypes.c_float]
    lib.rope_f32.argtypes = [p, i64, p, p, i32, i32, i32]
    lib.rope_f64.argtypes = [p, i64, p, p, i32, i32, i32]
    lib.silu_mul_f32.argtypes = [p, i64, p, i64, i32, i32]
    lib.gelu_tanh_mul_f32.argtypes = [p, i64, p, i64, i32, i32]
    lib.softcap_f32.argtypes = [p, i64, ctypes.c_float]
    for suffix in ("f32", "f64"):
        getattr(lib, f"kv_write_{suffix}").argtypes = [p, i64, p, i64, p, i64, p, i32, i32, i32, i32, i64]
        getattr(lib, f"kv_write_{suffix}").restype = None
    lib.argmax_rows_f32.argtypes = [p, i64, i32, i32, p]
    lib.argmax_rows_f32.restype = None
    lib.gemm_pack_f32.argtypes = [p, i64, i32, i32, p]
    lib.gemm_f32.argtypes = [p, i64, p, p, p, i64, i32, i32, i32]
    lib.gemm_f32.restype = i32
    lib.lm_head_argmax_f32.argtypes = [p, i64, p, i64, p, ctypes.c_float, p, p, p, i32, i32, i32, p]
    lib.lm_head_argmax_f32.restype = i32
    for name in ("add_rmsnorm_f32", "rope_f32", "rope_f64", "silu_mul_f32", "gemm_pack_f32"):
        getattr(lib, name).restype = None
    lib.decoder_layers_f32.argtypes = [p, i32, p]
    lib.copy_kv_blocks.argtypes = [p, i64, i64, p, i64, i64, p, i32, i64, i64]
    lib.copy_kv_blocks.restype = None
    lib.decoder_layers_f32.restype = i32
    lib.vector_bits = lib.kernels_vector_bits()  # 512, 256 (AVX2 + FMA) or 0 (the generic C only)
    lib.limits = (lib.paged_decode_max_heads(), lib.paged_decode_max_block(), lib.paged_decode_max_head_dim())
    return lib


_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}


class DecoderLayerF32(ctypes.Structure):
    """``decoder_layer_f32`` of cpu_ops.c: one layer's weights (packed for the GEMM) and KV cache."""
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("input_norm", "post_attention_norm", "qkv", "qkv_bias", "o", "o_bias", "gate_up", "down",
                 "kv_layer")]


class DecoderStepF32(ctypes.Structure):
    """``decoder_step_f32`` of cpu_ops.c: a step's sizes, inputs and workspaces
    (prefixkv/model/fused_stack.py fills it)."""
    _fields_ = ([(name, ctypes.c_int) for name in ("T", "hidden", "H", "KVH", "D", "BS", "inter", "max_blocks")]
                + [("nb1", ctypes.c_int64), ("eps", ctypes.c_float), ("scale", ctypes.c_float)]
                + [(name, ctypes.c_void_p) for name in ("h", "residual", "normed", "qkv", "attn", "o_out", "gate_up",
                                                        "act", "cos", "sin", "slots", "block_tables", "seq_lens",
                                                        "row_order")])


# ---------------------------------------------------------------------------------------------- GEMM
def gemm_available() -> bool:
    """Whether the library has its float32 GEMM (an AVX-512 or AVX2 + FMA build)."""
    lib = load()
    return lib is not None and lib.vector_bits > 0


def gemm_packed_numel(n: int, k: int, lib: ctypes.CDLL | None = None) -> int:
    """Floats of ``gemm_pack``'s result for a weight [n, k]."""
    width = (lib or load()).gemm_panel_width()
    return (n + width - 1) // width * k * width


def gemm_pack(weight: torch.Tensor, lib: ctypes.CDLL | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """weight [N, K] float32 (CPU, rows contiguous) -> its packed copy for ``gemm_caller``: panels of
    ``gemm_panel_width()`` output features, [ceil(N / width), K, width], zero-padded. ``lib``: a
    library from ``load_source`` instead of ``load()``'s. ``out``: a contiguous float32 tensor of
    ``gemm_packed_numel`` elements to pack into (a slice of one huge-page arena for all of a model's
    weights: ``hugepages.empty`` leaves a tensor under 4 MB in 4 KB pages)."""
    assert weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2, weight.shape
    assert weight.stride(1) == 1, weight.stride()
    lib = lib or load()
    n, k = weight.shape
    width = lib.gemm_panel_width()
    shape = ((n + width - 1) // width, k, width)
    if out is None:
        packed = hugepages.empty(shape, dtype=torch.float32)  # streamed every call
    else:
        assert out.dtype == torch.float32 and out.is_contiguous() and out.numel() == shape[0] * k * width, out.shape
        packed = out.view(shape)
    lib.gemm_pack_f32(weight.data_ptr(), weight.stride(0), n, k, packed.data_ptr())
    return packed


def gemm_caller(packed: torch.Tensor, n: int, bias: torch.Tensor | None = None, lib: ctypes.CDLL | None = None):
    """The GEMM with its packed weight bound: ``call(x)`` = x [M, K] float32 (rows contiguous, any row
    stride) @ W.T (+ bias) -> [M, n], W being the [n, K] weight ``packed`` came from. Each output is a
    sum, in order, of float32 FMA chains over 64 values of k each, then + bias: bitwise independent of
    M and of the row's place in x. The weight is checked once here, so that a call (121 a decode step
    on SmolLM2) costs one allocation and one ctypes call. The returned function holds the tensors.
    ``lib``: the library ``packed`` came from, if not ``load()``'s."""
    k = packed.shape[1]
    assert packed.dtype == torch.float32 and packed.is_contiguous() and packed.dim() == 3, packed.shape
    assert packed.shape[0] * packed.shape[2] >= n > packed.shape[0] * packed.shape[2] - packed.shape[2], (n, packed.shape)
    assert bias is None or (bias.shape == (n,) and bias.is_contiguous() and bias.dtype == torch.float32)
    fn, p_ptr, b_ptr = (lib or load()).gemm_f32, packed.data_ptr(), None if bias is None else bias.data_ptr()
    f32, empty = torch.float32, torch.empty

    def call(x: torch.Tensor, _keep=(packed, bias)) -> torch.Tensor:
        if x.dtype != f32 or x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1 or x.device.type != "cpu":
            raise ValueError(f"gemm: x must be a CPU float32 [M, {k}] with contiguous rows, "
                             f"got {x.dtype} {tuple(x.shape)} strides {x.stride()}")
        m = x.shape[0]
        y = empty((m, n), dtype=f32)
        if m:
            fn(x.data_ptr(), x.stride(0), p_ptr, b_ptr, y.data_ptr(), n, m, n, k)
        return y

    return call


def supports_decode(q: torch.Tensor, kv_cache_layer: torch.Tensor) -> bool:
    """Whether the decode kernel takes these shapes (and the library is built)."""
    lib = load()
    if lib is None or q.device.type != "cpu" or q.dtype not in _SUFFIX or kv_cache_layer.dtype != q.dtype:
        return False
    max_heads, max_block, max_head_dim = lib.limits
    _, h, d = q.shape
    bs = kv_cache_layer.shape[3]
    return h <= max_heads and bs <= max_block and d <= max_head_dim and kv_cache_layer.is_contiguous()


def supports_prefill(q: torch.Tensor, kv_cache_layer: torch.Tensor) -> bool:
    """The prefill kernel: float32, head_dim 64 or 128, AVX-512 or AVX2 (it reports 0 otherwise)."""
    return (q.dtype == torch.float32 and q.shape[2] in (64, 128) and supports_decode(q, kv_cache_layer)
            and q.stride(2) == 1 and q.stride(1) == q.shape[2])


def paged_prefill_attention(q: torch.Tensor, kv_cache_layer: torch.Tensor, block_tables: torch.Tensor,
                            seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                            out: torch.Tensor, window: int | None = None, softcap: float | None = None) -> bool:
    """Causal attention of prefill chunks: q [T, H, D] (rows may be strided) holds the query tokens
    of S sequences, ``query_start_loc`` [S + 1] int32 (from 0) delimits them; sequence s's queries
    are its last ``qlen`` positions of ``seq_lens[s]``. Writes out [T, H, D] (contiguous). False
    when the library has no kernel for these shapes (nothing written). ``window``: a query at p sees
    keys p - window < j <= p only; ``softcap``: scores -> softcap * tanh(score / softcap)."""
    t, h, d = q.shape
    _, nb1, kvh, bs, _ = kv_cache_layer.shape
    s = seq_lens.shape[0]
    assert query_start_loc.dtype == torch.int32 and query_start_loc.shape == (s + 1,), query_start_loc.shape
    assert block_tables.dtype == torch.int32 and block_tables.shape[0] == s and seq_lens.dtype == torch.int32
    assert out.shape == (t, h, d) and out.is_contiguous() and out.dtype == q.dtype
    block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
    return bool(load().paged_prefill_attention_f32(
        q.data_ptr(), q.stride(0), kv_cache_layer.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(),
        query_start_loc.data_ptr(), out.data_ptr(), s, h, kvh, d, bs, block_tables.shape[1], nb1, scale,
        window or 0, softcap or 0.0))


def paged_decode_attention(q: torch.Tensor, kv_cache_layer: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                           window: int | None = None, softcap: float | None = None,
                           order: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D] (one query per sequence, at its last position; rows may be strided, heads
    contiguous) -> out [B, H, D] (contiguous; allocated when not given). ``window``: the query sees
    its last ``window`` keys only (earlier blocks are not read); ``softcap``: scores capped.
    ``order``: int32 [B], a permutation of 0 .. B - 1, the order the threads take the rows in
    (``attention.base.prefix_order``; the results are the same bits in any order), None: in turn.

    kv_cache_layer [2, num_blocks + 1, KVH, BS, D]; block_tables [B, max_blocks] int32;
    seq_lens [B] int32 (context length including the query token). Call ``supports_decode`` first."""
    b, h, d = q.shape
    _, nb1, kvh, bs, d2 = kv_cache_layer.shape
    assert d2 == d and h % kvh == 0, (q.shape, kv_cache_layer.shape)
    assert q.stride(2) == 1 and q.stride(1) == d, q.stride()
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32, (block_tables.dtype, seq_lens.dtype)
    assert block_tables.shape[0] == b and seq_lens.shape == (b,), (block_tables.shape, seq_lens.shape)
    block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
    if out is None:
        out = torch.empty((b, h, d), dtype=q.dtype)
    assert out.shape == (b, h, d) and out.is_contiguous() and out.dtype == q.dtype
    if order is not None:
        assert order.dtype == torch.int32 and order.shape == (b,) and order.is_contiguous(), order
    fn = getattr(load(), f"paged_decode_attention_{_SUFFIX[q.dtype]}")
    fn(q.data_ptr(), q.stride(0), kv_cache_layer.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(),
       None if order is None else order.data_ptr(), out.data_ptr(), b, h, kvh, d, bs, block_tables.shape[1], nb1,
       scale, window or 0, softcap or 0.0)
    return out


def kv_write(k: torch.Tensor, v: torch.Tensor, kv_cache_layer: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """Writes k, v [T, KVH, D] (rows may be strided, heads contiguous: views into the qkv output)
    into the layer's cache at ``slot_mapping`` [T] int64; slots < 0 or past the cache are skipped.
    False (nothing written) where the library or these layouts are not what the kernel takes."""
    lib = load()
    if (lib is None or k.dtype not in _SUFFIX or v.dtype != k.dtype or kv_cache_layer.dtype != k.dtype
            or k.device.type != "cpu" or not kv_cache_layer.is_contiguous()):
        return False
    _, nb1, kvh, bs, d = kv_cache_layer.shape
    for x in (k, v):
        if x.dim() != 3 or x.shape[1:] != (kvh, d) or x.stride(2) != 1 or x.stride(1) != d:
            return False
    t = k.shape[0]
    assert v.shape[0] == t and slot_mapping.shape == (t,) and slot_mapping.dtype == torch.int64
    slots = slot_mapping.contiguous()
    getattr(lib, f"kv_write_{_SUFFIX[k.dtype]}")(
        k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), kv_cache_layer.data_ptr(), nb1 * kvh * bs * d,
        slots.data_ptr(), t, kvh, bs, d, nb1 * bs)
    return True


def copy_kv_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> bool:
    """dst[:, :, d] = src[:, :, s] for each (s, d) of ``pairs``: whole blocks of every layer between
    two CPU KV tensors [layers, 2, blocks, *block] of one dtype and block shape (the device pool, the
    host tier, a staging view): each block contiguous, the layers and halves flattening into one
    stride (as any contiguous tensor, or a permuted [blocks, layers, 2, *block] one). False (nothing
    copied) where the library or the tensors are not that."""
    lib = load()
    if not pairs:
        return True
    if (lib is None or src.device.type != "cpu" or dst.device.type != "cpu" or src.dtype != dst.dtype
            or src.dim() < 4 or src.shape[:2] != dst.shape[:2] or src.shape[3:] != dst.shape[3:]):
        return False
    for x in (src, dst):
        if x.stride(0) != 2 * x.stride(1) and x.shape[0] > 1 or not x[0, 0, 0].is_contiguous():
            return False
    nb_src, nb_dst = src.shape[2], dst.shape[2]
    if any(not (0 <= s < nb_src and 0 <= d < nb_dst) for s, d in pairs):
        raise IndexError(f"copy_kv_blocks: a block id out of range ({nb_src} source, {nb_dst} destination blocks)")
    idx = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)
    e = src.element_size()
    lib.copy_kv_blocks(src.data_ptr(), src.stride(1) * e, src.stride(2) * e, dst.data_ptr(), dst.stride(1) * e,
                       dst.stride(2) * e, idx.data_ptr(), len(pairs), src.shape[0] * src.shape[1],
                       src[0, 0, 0].numel() * e)
    return True


def move_kv_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """dst[:, :, d] = src[:, :, s] for each (s, d) of ``pairs`` (KV tensors [layers, 2, blocks,
    *block]): ``copy_kv_blocks`` where both are CPU tensors it takes, else torch's indexing (across
    devices too)."""
    if not pairs or copy_kv_blocks(src, dst, pairs):
        return
    s = torch.tensor([a for a, _ in pairs], dtype=torch.int64, device=src.device)
    d = torch.tensor([b for _, b in pairs], dtype=torch.int64, device=dst.device)
    dst.index_copy_(2, d, src.index_select(2, s).to(dst.device))


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """float32 [R, N] (rows contiguous) -> int64 [R], each row's first largest index (first NaN if
    any), exactly torch.argmax(x, -1); None where the library is not built or x is not that."""
    lib = load()
    if (lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.stride(1) != 1
            or x.shape[1] == 0):
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if x.shape[0]:
        lib.argmax_rows_f32(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr())
    return out


def lm_head_argmax(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                   packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """Greedy decoding's last step in one call: float32 x, residual [M, K] (rows contiguous) ->
    int64 [M], each row's argmax (first largest index, first NaN if any) over the logits
    ``gemm_caller(packed, n, bias)(add_rmsnorm(x, residual, norm_weight, eps)[0])`` would return,
    bitwise those values, never written (tests/test_linear.py). None where the library has no GEMM
    or its scratch could not be allocated."""
    lib = load()
    m, k = x.shape
    for t in (x, residual, norm_weight, packed, *(() if bias is None else (bias,))):
        assert t.dtype == torch.float32 and t.device.type == "cpu", (t.dtype, t.device)
    assert residual.shape == (m, k) and x.stride(1) == 1 and residual.stride(1) == 1
    assert norm_weight.is_contiguous() and norm_weight.shape == (k,)
    assert packed.is_contiguous() and packed.shape[1] == k and packed.shape[0] * packed.shape[2] >= n
    assert bias is None or (bias.shape == (n,) and bias.is_contiguous())
    out = torch.empty(m, dtype=torch.int64)
    normed = torch.empty((m, k), dtype=torch.float32)
    if m and not lib.lm_head_argmax_f32(x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0),
                                        norm_weight.data_ptr(), eps, normed.data_ptr(), packed.data_ptr(),
                                        None if bias is None else bias.data_ptr(), m, n, k, out.data_ptr()):
        return None
    return out


# ---------------------------------------------------------------------------------------- elementwise
def _rows(x: torch.Tensor) -> int:
    """Row stride of a [T, N] tensor whose rows are contiguous (asserted)."""
    assert x.dim() == 2 and x.stride(1) == 1, (x.shape, x.stride())
    return x.stride(0)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [T, N]: h = x + residual (x alone when None); returns (rmsnorm(h) * weight, h)."""
    assert x.dtype == torch.float32 and weight.dtype == torch.float32 and weight.is_contiguous()
    t, n = x.shape
    out = torch.empty((t, n), dtype=x.dtype)
    h = torch.empty((t, n), dtype=x.dtype)
    r_ptr, r_ld = (0, 0) if residual is None else (residual.data_ptr(), _rows(residual))
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
    load().add_rmsnorm_f32(x.data_ptr(), _rows(x), r_ptr or None, r_ld, h.data_ptr(), n, weight.data_ptr(),
                           out.data_ptr(), n, t, n, eps)
    return out, h


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place: x [T, heads, D] (rows may be strided, a view into the fused qkv output) becomes
    ``x * cos + rotate_half(x) * sin`` with cos/sin [T, D]; bit-identical to those torch ops."""
    t, heads, d = x.shape
    assert x.stride(2) == 1 and x.stride(1) == d, x.stride()
    assert cos.shape == (t, d) and sin.shape == (t, d) and cos.is_contiguous() and sin.is_contiguous()
    assert cos.dtype == sin.dtype == x.dtype and x.dtype in _SUFFIX
    getattr(load(), f"rope_{_SUFFIX[x.dtype]}")(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(),
                                                t, heads, d)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """float32 gate_up [T, 2 * I] (gate, then up) -> gelu_tanh(gate) * up [T, I] (Gemma's GeGLU),
    each element computed on its own (a row's result does not depend on the other rows)."""
    assert gate_up.dtype == torch.float32
    t, n2 = gate_up.shape
    out = torch.empty((t, n2 // 2), dtype=gate_up.dtype)
    load().gelu_tanh_mul_f32(gate_up.data_ptr(), _rows(gate_up), out.data_ptr(), n2 // 2, t, n2 // 2)
    return out


def softcap_(x: torch.Tensor, cap: float) -> torch.Tensor:
    """In place on a contiguous float32 tensor: x = cap * tanh(x / cap), element by element."""
    assert x.dtype == torch.float32 and x.is_contiguous()
    load().softcap_f32(x.data_ptr(), x.numel(), cap)
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """float32 gate_up [T, 2 * I] (gate, then up) -> silu(gate) * up [T, I]."""
    assert gate_up.dtype == torch.float32
    t, n2 = gate_up.shape
    out = torch.empty((t, n2 // 2), dtype=gate_up.dtype)
    load().silu_mul_f32(gate_up.data_ptr(), _rows(gate_up), out.data_ptr(), n2 // 2, t, n2 // 2)
    return out
