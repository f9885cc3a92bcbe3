"""The two vector builds of the C kernels (prefixkv/csrc/cpu_ops.c): AVX-512 and AVX2 + FMA.

A machine runs only what its CPU has, so on an AVX-512 machine the AVX2 build is made with
``PREFIXKV_CPU_KERNELS=avx2`` (``-mno-avx512f``) and checked in a subprocess: the kernel and GEMM
tests pass against it, and its GEMM gives bitwise the AVX-512 GEMM's results (the same per-element
sums, 8 lanes instead of 16). On an AVX2 machine the default build is the AVX2 one; these skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prefixkv import cpu_ops

lib = cpu_ops.load()
ROOT = Path(__file__).resolve().parent.parent
needs_avx512 = pytest.mark.skipif(lib is None or lib.vector_bits != 512,
                                  reason="the AVX2 build is checked against the AVX-512 one on AVX-512 machines")

# SmolLM2's projection shapes plus ragged ones (N not a multiple of either panel width, K not of 64)
SHAPES = [(576, 960), (1536, 576), (576, 3072), (100, 7), (33, 50), (64, 1)]
ROWS = [1, 3, 4, 5, 16, 17, 130]

_GEMMS = """
import sys, torch
from prefixkv import cpu_ops
assert cpu_ops.load().vector_bits == int(sys.argv[2]), cpu_ops.load().vector_bits
out = {}
for k, n in %r:
    g = torch.Generator().manual_seed(k * 7 + n)
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g)
    call = cpu_ops.gemm_caller(cpu_ops.gemm_pack(w), n, b)
    for m in %r:
        out[(k, n, m)] = call(torch.randn(m, k, generator=torch.Generator().manual_seed(m)))
torch.save(out, sys.argv[1])
""" % (SHAPES, ROWS)


def _env(isa: str | None) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("PREFIXKV_CPU_KERNELS", None)
    if isa:
        env["PREFIXKV_CPU_KERNELS"] = isa
    return env


def test_the_library_reports_its_build():
    if lib is None:
        pytest.skip("no C compiler")
    assert lib.vector_bits in (0, 256, 512)
    assert cpu_ops.gemm_available() is (lib.vector_bits > 0)
    if os.environ.get("PREFIXKV_CPU_KERNELS") == "avx2":
        assert lib.vector_bits == 256


@needs_avx512
def test_avx2_gemm_gives_the_avx512_gemms_bits(tmp_path):
    files = {}
    for isa, bits in ((None, 512), ("avx2", 256)):
        files[bits] = tmp_path / f"gemm-{bits}.pt"
        subprocess.run([sys.executable, "-c", _GEMMS, str(files[bits]), str(bits)], env=_env(isa), check=True,
                       timeout=600)
    wide, narrow = torch.load(files[512]), torch.load(files[256])
    assert wide.keys() == narrow.keys() and len(wide) == len(SHAPES) * len(ROWS)
    for key in wide:
        assert torch.equal(wide[key], narrow[key]), key


@needs_avx512
def test_avx2_build_passes_the_kernel_tests():
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/test_cpu_kernels.py", "tests/test_linear.py", "tests/test_batch_invariance.py",
                          "tests/test_fused_stack.py",
                          "tests/test_kernel_builds.py::test_the_library_reports_its_build"],
                         cwd=ROOT, env=_env("avx2"), capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert " passed" in res.stdout and " skipped" not in res.stdout.splitlines()[-1], res.stdout[-1000:]
