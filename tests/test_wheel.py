"""The built wheel works outside the source checkout: installed into a fresh virtualenv (its
dependencies borrowed from the test venv through a .pth line, so no download), it serves the
embedded model and finds its kernel sources: the C CPU kernels build from the installed copy, and
a CUDA kernel compiles with nvcc where nvcc exists."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHECK = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    import prefixkv
    from prefixkv import LLM, SamplingParams, cpu_ops
    from prefixkv.attention import cuda
    from prefixkv.server import webui
    pkg = Path(prefixkv.__file__).parent
    lib = cpu_ops.load()
    out = LLM(max_num_seqs=2, num_kv_blocks=64).generate([[1, 2, 3, 4]], SamplingParams(max_tokens=3, temperature=0.0))
    print(json.dumps(dict(pkg=str(pkg), cu=sorted(p.name for p in cuda.CUDA_SOURCE_DIR.glob("*.cu*")),
                          cuda_dir=str(cuda.CUDA_SOURCE_DIR), csrc=cpu_ops.SOURCE.is_file(),
                          cpu_kernels=lib is not None, tokens=out[0].outputs[0].token_ids,
                          static=sorted(str(p.relative_to(webui.STATIC_DIR)) for p in webui.STATIC_DIR.rglob("*")
                                        if p.is_file()))))
""")


@pytest.mark.slow
def test_wheel_installs_and_finds_its_kernel_sources(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels), str(ROOT)], check=True, timeout=300, cwd=tmp_path)
    wheel = next(wheels.glob("prefixkv-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "borrowed-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, timeout=300)
    env = dict(os.environ, PREFIXKV_CACHE_DIR=str(tmp_path / "cache"))
    if (Path.home() / ".cache" / "prefixkv").is_dir():  # reuse the converted embedded model, if any
        for d in (Path.home() / ".cache" / "prefixkv").glob("SmolLM2*"):
            shutil.copytree(d, tmp_path / "cache" / d.name)
    res = subprocess.run([str(py), "-c", CHECK], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    import json

    info = json.loads(res.stdout.strip().splitlines()[-1])
    assert info["pkg"].startswith(str(site)), info  # the installed copy, not the checkout
    assert info["cu"] == ["cache_ops.cu", "common.cuh", "paged_decode.cu", "paged_prefill.cu"]
    assert info["csrc"] and info["cpu_kernels"]
    assert info["static"] == sorted(str(p.relative_to(ROOT / "prefixkv/server/static"))
                                    for p in (ROOT / "prefixkv/server/static").rglob("*") if p.is_file())
    assert len(info["tokens"]) == 3
    assert any((tmp_path / "cache" / "kernels").glob("cpu_ops-*.so"))  # built from the installed source
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if nvcc:
        cu = Path(info["cuda_dir"])
        r = subprocess.run([nvcc, "-cubin", "-arch=sm_90", "-std=c++17", f"-I{cu}", "-o", str(tmp_path / "k.cubin"),
                            str(cu / "cache_ops.cu")], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
