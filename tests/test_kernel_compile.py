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
    """Every instantiation compiles for sm_80 and sm_90 with warnings as errors and without register
    spills (fp32 decode at head_dim 256, GROUP 8 spilled 156 bytes on sm_90 before its launch bounds
    asked for 2 CTAs per SM)."""
    proc = subprocess.run([sys.executable, str(KERNEL_CHECK), "--fail-on-spill"], capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert " 0 with spills; ok" in proc.stdout
    for kernel in ("paged_decode_kernel", "paged_decode_reduce_kernel", "paged_prefill_kernel",
                   "paged_prefill_mma_kernel", "write_kv_kernel", "copy_blocks_kernel"):
        assert kernel in proc.stdout, f"{kernel} missing from the report:\n{proc.stdout}"
    for arch in ("sm_80", "sm_90"):
        assert arch in proc.stdout
    # the matrix the issue asks for: fp16 / bf16 / fp32, head_dim 64 and 128, block sizes 16 and 32
    for t in ("half_t", "bf16_t", "float"):
        for d in (64, 128):
            for bs in (16, 32):
                assert f"paged_decode_kernel<{t}, {d}, {bs}," in proc.stdout
                assert f"paged_prefill_kernel<{t}, {d}, {bs}>" in proc.stdout
                if t != "float":
                    assert f"paged_prefill_mma_kernel<{t}, {d}, {bs}>" in proc.stdout
        for d in (80, 96):  # lanes without V dims, 4-byte SIMT columns, five / six k16 blocks
            assert f"paged_decode_kernel<{t}, {d}, 16, 4, false>" in proc.stdout
            assert f"paged_decode_reduce_kernel<{t}, {d}>" in proc.stdout
    for kernel in ("paged_prefill_kernel<half_t, 80, 16>", "paged_prefill_kernel<float, 96, 16>",
                   "paged_prefill_mma_kernel<bf16_t, 80, 16>", "paged_prefill_mma_kernel<half_t, 96, 16>"):
        assert kernel in proc.stdout


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


def test_missing_cupy_is_a_clear_error():
    import importlib.util

    from prefixkv.attention import cuda

    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("cupy is installed here")
    with pytest.raises(ImportError, match="CuPy"):
        cuda._cupy()


def test_name_expressions_cover_what_the_wrappers_launch():
    """name_expressions (used by kernel_check --nvrtc) lists the instantiations a model can launch."""
    from prefixkv.attention import cuda

    names = cuda.name_expressions(torch.bfloat16, 128, 16, 4)
    assert names["paged_decode.cu"] == ["prefixkv::paged_decode_kernel<prefixkv::bf16_t, 128, 16, 4, false>",
                                        "prefixkv::paged_decode_kernel<prefixkv::bf16_t, 128, 16, 4, true>",
                                        "prefixkv::paged_decode_reduce_kernel<prefixkv::bf16_t, 128>"]
    assert names["paged_prefill.cu"] == ["prefixkv::paged_prefill_kernel<prefixkv::bf16_t, 128, 16>",
                                         "prefixkv::paged_prefill_mma_kernel<prefixkv::bf16_t, 128, 16>"]
    assert cuda.name_expressions(torch.float32, 64, 32, 1)["paged_prefill.cu"] == [
        "prefixkv::paged_prefill_kernel<float, 64, 32>"]


def test_launch_constants_match_the_kernel_sources():
    """The wrapper's block sizes, partition size and tile rows are copies of constants in cuda/*.cu."""
    import re

    from prefixkv.attention import cuda

    def const(file_name: str, name: str) -> int:
        m = re.search(rf"inline constexpr int {name} = (\w+);", (ROOT / "cuda" / file_name).read_text())
        assert m, f"{name} not found in {file_name}"
        return int(m.group(1)) if m.group(1).isdigit() else {"WARP_SIZE": 32}[m.group(1)]

    assert const("paged_decode.cu", "DECODE_NUM_WARPS") * 32 == cuda._DECODE_THREADS
    assert const("paged_decode.cu", "DECODE_PARTITION_SIZE") == cuda.DECODE_PARTITION_SIZE
    assert const("paged_prefill.cu", "PREFILL_NUM_THREADS") == cuda._PREFILL_THREADS
    assert const("paged_prefill.cu", "PREFILL_MMA_BLOCK_M") == cuda._PREFILL_MMA_BLOCK_M
    assert const("cache_ops.cu", "CACHE_OPS_THREADS") == cuda._CACHE_OPS_THREADS
    simt = (ROOT / "cuda" / "paged_prefill.cu").read_text()
    assert "WIDE = ROW_BYTES > 256" in simt and "BLOCK_M = WIDE ? 32 : 64" in simt
    assert cuda._prefill_block_m("simt", torch.float32, 128) == 32  # 512-byte rows
    assert cuda._prefill_block_m("simt", torch.float16, 128) == 64
