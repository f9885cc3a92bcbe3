"""CPU-side checks of the CUDA backend: the kernels compile with nvcc (warnings as errors) for
sm_80 and sm_90, and the Python module imports and validates arguments without cupy or a GPU."""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
KERNEL_CHECK = ROOT / "tools" / "kernel_check"


def _nvcc_available() -> bool:
    return runpy.run_path(str(KERNEL_CHECK))["find_nvcc"]() is not None


@pytest.mark.skipif(not _nvcc_available(), reason="nvcc not installed")
def test_kernel_check_passes():
    proc = subprocess.run([sys.executable, str(KERNEL_CHECK)], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for kernel in ("paged_decode_kernel", "paged_decode_reduce_kernel", "paged_prefill_kernel",
                   "paged_prefill_mma_kernel", "write_kv_kernel", "copy_blocks_kernel"):
        assert kernel in proc.stdout, f"{kernel} missing from the report:\n{proc.stdout}"
    for arch in ("sm_80", "sm_90"):
        assert arch in proc.stdout


def test_cuda_module_imports_without_cupy_or_gpu():
    from prefixkv.attention import cuda

    assert cuda.CudaAttentionBackend.name == "cuda"
    source = cuda._source("paged_prefill.cu")
    assert '#include "' not in source and "#pragma once" not in source
    assert source.count("struct PrefillTile {") == 1 and source.count("struct alignas(2) half_t") == 1


def test_wrapper_rejects_bad_arguments_before_launching():
    from prefixkv.attention import cuda

    cache = torch.zeros((2, 5, 2, 16, 64), dtype=torch.float16)
    q = torch.zeros((3, 4, 64), dtype=torch.float16)
    tables = torch.zeros((3, 2), dtype=torch.int32)
    lens = torch.ones(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="CUDA tensor"):
        cuda.paged_decode_attention(q, cache, tables, lens, 0.125, 16)
    with pytest.raises(ValueError, match="kv_cache_layer"):
        cuda.write_kv(q, q, cache[0], torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="kv_cache"):
        cuda.copy_blocks(cache, torch.zeros((1, 2), dtype=torch.int64))


def test_decode_group_choice():
    from prefixkv.attention.cuda import _decode_group

    assert [_decode_group(n) for n in (1, 4, 7, 8, 12, 16, 11, 32)] == [1, 4, 7, 8, 6, 8, 8, 8]
