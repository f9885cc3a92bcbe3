"""The C kernels of ``prefixkv/csrc/cpu_ops.c``: built once per machine, called through ctypes.

``load()`` compiles the source with the system C compiler (``$CC`` or ``cc``; ``-O3 -march=native
-fopenmp``) into the prefixkv cache directory, keyed by a hash of the source, the flags, the
compiler's version and this CPU's feature flags, written to a temporary file and renamed (a
concurrent start-up finds either nothing or a whole library). It returns None where no compiler
works; the callers then keep the torch path.

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

from prefixkv.cache_dir import cache_root

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "cpu_ops.c"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def _build(cc: str) -> Path:
    src = SOURCE.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(b"\0".join([src, " ".join(CFLAGS).encode(), version.encode(),
                                     _cpu_flags().encode()])).hexdigest()[:16]
    out = cache_root() / "kernels" / f"cpu_ops-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".cpu_ops-", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        res = subprocess.run([cc, *CFLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True,
                             timeout=300)
        if res.returncode != 0:
            raise RuntimeError(f"{cc} failed: {res.stderr.strip()[:2000]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel library, or None (no working C compiler, or ``PREFIXKV_CPU_KERNELS=0``)."""
    if os.environ.get("PREFIXKV_CPU_KERNELS", "1") == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        print(f"prefixkv: CPU kernels unavailable ({e}); using the torch attention path", file=sys.stderr)
        return None
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    for suffix, scalar in (("f32", ctypes.c_float), ("f64", ctypes.c_double)):
        fn = getattr(lib, f"paged_decode_attention_{suffix}")
        fn.argtypes = [p, p, p, p, p, i32, i32, i32, i32, i32, i32, i64, scalar]
        fn.restype = None
    lib.limits = (lib.paged_decode_max_heads(), lib.paged_decode_max_block(), lib.paged_decode_max_head_dim())
    return lib


_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}


def supports(q: torch.Tensor, kv_cache_layer: torch.Tensor) -> bool:
    """Whether the decode kernel takes these shapes (and the library is built)."""
    lib = load()
    if lib is None or q.device.type != "cpu" or q.dtype not in _SUFFIX or kv_cache_layer.dtype != q.dtype:
        return False
    max_heads, max_block, max_head_dim = lib.limits
    _, h, d = q.shape
    bs = kv_cache_layer.shape[3]
    return h <= max_heads and bs <= max_block and d <= max_head_dim and kv_cache_layer.is_contiguous()


def paged_decode_attention(q: torch.Tensor, kv_cache_layer: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, D] (one query per sequence, at its last position) -> [B, H, D].

    kv_cache_layer [2, num_blocks + 1, KVH, BS, D]; block_tables [B, max_blocks] int32;
    seq_lens [B] int32 (context length including the query token). Call ``supports`` first."""
    b, h, d = q.shape
    _, nb1, kvh, bs, d2 = kv_cache_layer.shape
    assert d2 == d and h % kvh == 0, (q.shape, kv_cache_layer.shape)
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32, (block_tables.dtype, seq_lens.dtype)
    assert block_tables.shape[0] == b and seq_lens.shape == (b,), (block_tables.shape, seq_lens.shape)
    q = q.contiguous()
    block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
    out = torch.empty_like(q)
    fn = getattr(load(), f"paged_decode_attention_{_SUFFIX[q.dtype]}")
    fn(q.data_ptr(), kv_cache_layer.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(), out.data_ptr(),
       b, h, kvh, d, bs, block_tables.shape[1], nb1, scale)
    return out
