"""tools/gpu_check fails fast, and says why, on a machine without a GPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_gpu_check_fails_fast_without_cuda(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    res = subprocess.run([str(ROOT / "tools" / "gpu_check")], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 3
    assert "no CUDA device" in res.stderr
