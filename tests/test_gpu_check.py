"""The GPU path's CPU-side checks: tools/gpu_check fails fast without a GPU and keeps its time
limits, tests/gpu runs without pytest (tests/gpu/minirunner.py), gpu_bench's summary against the
targets, and `--device cuda` / `--enforce-eager` reach the engine configuration."""

from __future__ import annotations

import argparse
import json
import os
import runpy
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_gpu_check_fails_fast_without_cuda(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    t0 = time.monotonic()
    res = subprocess.run([str(ROOT / "tools" / "gpu_check")], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 3, res.stdout + res.stderr
    assert "no CUDA device" in res.stderr
    assert time.monotonic() - t0 < 30
    status = json.loads((tmp_path / "gpu_check.json").read_text())
    assert status["phases"]["preflight"]["rc"] == 3 and "no CUDA device" in status["phases"]["preflight"]["output"]


def test_gpu_check_phase_is_killed_at_its_limit_and_keeps_its_output(tmp_path, monkeypatch):
    """A phase that hangs mid-line (as a hung test under `pytest -v` does) is killed at its limit;
    what it printed is in its log and the status file says it timed out."""
    monkeypatch.setenv("OUT", str(tmp_path))
    mod = runpy.run_path(str(ROOT / "tools" / "gpu_check"), run_name="gpu_check_under_test")
    status = mod["Status"]()
    hang = "import sys, time; print('before'); sys.stdout.write('test_x '); sys.stdout.flush(); time.sleep(60)"
    t0 = time.monotonic()
    rc = mod["run_phase"](status, "hang", [sys.executable, "-c", hang], cap_s=2, min_s=1)
    assert rc == 124 and time.monotonic() - t0 < 10
    assert "before\ntest_x " in (tmp_path / "hang.log").read_text()
    phase = json.loads((tmp_path / "gpu_check.json").read_text())["phases"]["hang"]
    assert phase["timed_out"] and phase["rc"] == 124
    assert mod["run_phase"](status, "ok", [sys.executable, "-c", "print(1)"], cap_s=20, min_s=1) == 0


def test_gpu_check_dry_run_plans_the_decode_phase_then_the_rest(tmp_path, monkeypatch):
    """--dry-run runs nothing and writes the plan: the decode-path checks (issue 44) first, in their
    own phase, and not again in the tests phase, with pytest or with the built-in runner."""
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    res = subprocess.run([str(ROOT / "tools" / "gpu_check"), "--dry-run"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    plan = json.loads((tmp_path / "gpu_check.json").read_text())["dry_run"]
    assert [p["phase"] for p in plan] == ["preflight", "decode", "tests", "micro", "model", "e2e", "graphs"]
    decode, tests = plan[1]["command"], plan[2]["command"]
    assert "tests/gpu/test_decode_paths.py" in decode and (ROOT / "tests/gpu/test_decode_paths.py").is_file()
    assert "--ignore=tests/gpu/test_decode_paths.py" in tests and f"--junitxml={tmp_path / 'gpu_tests.xml'}" in tests
    assert sum(p["cap_seconds"] for p in plan[:3]) < 285  # the checks before the benchmarks fit the budget
    assert not (tmp_path / "preflight.log").exists()

    monkeypatch.setenv("OUT", str(tmp_path))
    mod = runpy.run_path(str(ROOT / "tools" / "gpu_check"), run_name="gpu_check_under_test")
    shim = mod["tests_command"]("gpu_tests", ["tests/gpu"], [mod["DECODE_TESTS"]], use_pytest=False)
    files = [a for a in shim if a.startswith("tests/gpu/test_")]
    want = sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests" / "gpu").glob("test_*.py"))
    assert files == [f for f in want if f != "tests/gpu/test_decode_paths.py"] and "--json" in shim


def test_gpu_check_counts_a_test_phase_that_passed_nothing_as_failed(tmp_path, monkeypatch):
    """A test phase whose tests were all skipped (no GPU after all) fails, its counts recorded."""
    monkeypatch.setenv("OUT", str(tmp_path))
    mod = runpy.run_path(str(ROOT / "tools" / "gpu_check"), run_name="gpu_check_under_test")
    status = mod["Status"]()
    xml = ('<testsuites><testsuite tests="3" failures="0" errors="0" skipped="3"></testsuite></testsuites>')
    write = f"open({str(tmp_path / 'gpu_decode.xml')!r}, 'w').write({xml!r})"
    assert mod["run_tests_phase"](status, "decode", "gpu_decode", [sys.executable, "-c", write], cap_s=20) == 1
    phase = json.loads((tmp_path / "gpu_check.json").read_text())["phases"]["decode"]
    assert phase["rc"] == 1 and phase["counts"] == {"passed": 0, "failed": 0, "skipped": 3}


MINI_TESTS = '''
import pytest

pytestmark = pytest.mark.gpu
SEEN = []


@pytest.fixture(scope="module", autouse=True)
def setup_once():
    SEEN.append("setup")
    yield
    SEEN.append("teardown")


@pytest.fixture(scope="module", params=["a", "b"])
def model(request, tmp_path_factory):
    SEEN.append(f"model {request.param}")
    return request.param, tmp_path_factory.mktemp(f"m-{request.param}")


@pytest.mark.parametrize("x", [1, 2])
@pytest.mark.parametrize("y,z", [(3, 4), (5, 6)])
def test_params(x, y, z):
    assert x in (1, 2) and z == y + 1


def test_model(model, tmp_path):
    name, path = model
    assert path.is_dir() and tmp_path.is_dir()


def test_raises_and_skip():
    with pytest.raises(ValueError, match="bad"):
        raise ValueError("a bad value")
    pytest.skip("skipped on purpose")


def test_fails():
    assert SEEN.count("setup") == 1  # a module fixture is set up once
    assert 1 == 2, "expected failure"
'''


def test_minirunner_runs_tests_without_pytest(tmp_path):
    test_file = tmp_path / "test_mini.py"
    test_file.write_text(textwrap.dedent(MINI_TESTS))
    out = tmp_path / "results.json"
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "minirunner.py"), "--force-shim", "--json",
                          str(out), str(test_file)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1, res.stdout + res.stderr  # test_fails fails
    results = json.loads(out.read_text())
    assert results["counts"] == {"passed": 6, "failed": 1, "skipped": 1}, res.stdout
    outcomes = {r["nodeid"].split("::")[1]: r["outcome"] for r in results["results"]}
    assert outcomes["test_model[model0]"] == outcomes["test_model[model1]"] == "passed"
    assert outcomes["test_fails"] == "failed" and "expected failure" in res.stdout
    assert sum(k.startswith("test_params[") for k in outcomes) == 4


def test_minirunner_on_tests_gpu_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "minirunner.py"), "--force-shim"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "test_kernels.py SKIPPED" in res.stdout and "0 failed" in res.stdout
    assert "test_decode_paths.py SKIPPED" in res.stdout  # imports and skips at module level


def test_gpu_bench_summary_against_targets():
    bench = runpy.run_path(str(ROOT / "tools" / "gpu_bench.py"), run_name="gpu_bench_under_test")
    data = {"decode_attention": {"no_split": {"fraction_of_copy_bw": 0.6}, "split_k": {"fraction_of_copy_bw": 0.75}},
            "e2e_decode": {"prefixkv_graphs": {"capture_seconds": 2.5}, "ratio_vs_hf_generate_batch": 1.5}}
    s = bench["summary"](data)
    assert s["decode_attention_fraction_of_copy_bw"] == {"value": 0.75, "target": 0.7, "met": True}
    assert s["graph_capture_all_buckets_seconds"]["met"] is True
    assert s["e2e_ratio_vs_hf_generate_batch"]["met"] is False
    assert s["graph_speedup_batch8"] == {"value": None, "target": 1.5, "met": None}  # not measured: no verdict


def test_cli_device_cuda_and_enforce_eager_reach_the_engine_config():
    from prefixkv.cli import add_engine_args, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_config_from_args(p.parse_args(["--device", "cuda", "--enforce-eager"]))
    assert (cfg.device, cfg.dtype, cfg.enforce_eager) == ("cuda", "auto", True)  # the checkpoint's half dtype
    cfg = engine_config_from_args(p.parse_args(["--device", "cuda", "--gpu-memory-utilization", "0.5",
                                                "--attention-backend", "torch"]))
    assert (cfg.gpu_memory_utilization, cfg.attention_backend, cfg.cache.kv_cache_memory_bytes) == (0.5, "torch", None)
    cfg = engine_config_from_args(p.parse_args(["--device", "cuda"]))
    assert (cfg.device, cfg.enforce_eager) == ("cuda", False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_engine_without_gpu_says_so():
    from prefixkv import LLM
    from prefixkv.cli import main

    with pytest.raises(ValueError, match="cuda"):
        LLM(device="cuda", dtype="bfloat16")
    assert main(["serve", "--device", "cuda", "--enforce-eager", "--port", "0"]) == 2
