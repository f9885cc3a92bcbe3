"""Smoke test of ``python -m bench``: every workload at tiny sizes on a tiny random model (float64),
systems prefixkv and hf-static; the JSON has its fields and prefixkv's greedy tokens equal
hf-static's on the shared-prefix workload."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.__main__ import main

COMMON = ["--dtype", "float64", "--systems", "prefixkv,hf-static", "--no-plot", "--no-progress",
          "--kv-tokens", "4096", "--max-num-batched-tokens", "64", "--max-num-seqs", "8"]
TINY = {
    "shared-prefix": ["--groups", "2", "--per-group", "3", "--system-tokens", "40", "--question-tokens", "9",
                      "--output-tokens", "5"],
    "multi-turn": ["--conversations", "3", "--turns", "3", "--system-tokens", "20", "--user-tokens", "12",
                   "--output-tokens", "4"],
    "cold": ["--num-requests", "5", "--min-tokens", "8", "--max-tokens", "60", "--output-tokens", "4"],
    "parallel-sampling": ["--num-requests", "2", "--prompt-tokens", "30", "--output-tokens", "3", "--n", "4"],
}
SYSTEM_FIELDS = ("wall_s", "cpu_s", "output_tokens", "output_tokens_per_s", "prompt_tokens_submitted",
                 "prompt_tokens_computed", "repeats", "error")
ENGINE_FIELDS = ("prefix_hit_tokens", "prefix_hit_rate", "kv_util_logical", "kv_util_physical",
                 "internal_fragmentation", "peak_blocks_in_use", "num_steps")


def _run(argv: list[str], out: Path, stem: str) -> dict:
    assert main(argv + ["--out", str(out), "--stem", stem]) == 0
    return json.loads((out / f"{stem}.json").read_text())


@pytest.mark.parametrize("workload", list(TINY))
def test_workload(tiny_llama, tmp_path, workload):
    doc = _run([workload, "--model", str(tiny_llama)] + TINY[workload] + COMMON, tmp_path, workload)
    assert doc["workload"] == workload and doc["command"].startswith("python -m bench")
    assert doc["machine"]["torch_threads"] == 2
    for name in ("prefixkv", "hf-static"):
        r = doc["systems"][name]
        assert r["error"] is None, r.get("traceback")
        for f in SYSTEM_FIELDS:
            assert f in r, f
        assert r["output_tokens"] > 0 and r["output_tokens_per_s"] > 0
    pk = doc["systems"]["prefixkv"]
    for f in ENGINE_FIELDS:
        assert pk[f] is not None, f
    assert 0 < pk["kv_util_logical"] <= 1 and pk["peak_blocks_in_use"] > 0
    assert pk["prompt_tokens_computed"] == pk["prompt_tokens_submitted"] - pk["prefix_hit_tokens"]
    assert doc["ratios"]["prefixkv"]["hf-static"] > 0
    if workload == "shared-prefix":
        # 2 groups x 3 requests; the 40-token system prompt holds 2 full 16-token blocks
        assert pk["prefix_hit_tokens"] >= 4 * 32
        ident = doc["output_identity"]
        assert ident["reference"] == "hf-static"
        assert ident["systems"]["prefixkv"]["identical_fraction"] == 1.0, ident
    if workload == "multi-turn":
        assert pk["prefix_hit_rate"] > 0.3  # later turns find their history cached
    if workload == "cold":
        assert pk["prefix_hit_tokens"] == 0


def test_ablate_and_micro(tiny_llama, tmp_path):
    doc = _run(["ablate", "--model", str(tiny_llama), "--on", "shared-prefix", "--block-sizes", "1,64",
                "--ablations", "policy,cache,chunked,block-size"] + TINY["shared-prefix"]
               + [a for a in COMMON if a not in ("--systems", "prefixkv,hf-static")], tmp_path, "ablate")
    assert {"prefixkv", "policy=static", "prefix-cache=off", "chunked-prefill=off", "block-size=1",
            "block-size=64"} <= set(doc["systems"])
    assert all(r["error"] is None for r in doc["systems"].values())
    sweep = {p["block_size"]: p for p in doc["block_size_sweep"]}
    assert sweep[1]["kv_util_logical"] == 1.0 and sweep[64]["kv_util_logical"] < sweep[16]["kv_util_logical"]
    doc = _run(["sched-overhead", "--sizes", "4,8", "--steps", "5", "--no-plot"], tmp_path, "sched")
    assert [r["num_running"] for r in doc["results"]] == [4, 8]
    assert all(r["scheduler_us_per_req"] > 0 for r in doc["results"])
    doc = _run(["memory", "--num-requests", "40", "--budget-tokens", "2048", "--max-model-len", "512",
                "--max-prompt", "200", "--max-output", "64"], tmp_path, "mem")
    paged, paged_no_wm, paged_wm5, *contig = doc["results"]
    assert [r["policy"] for r in (paged, paged_no_wm, paged_wm5)] == [
        "paged (block_size=16, watermark=0.01)", "paged (block_size=16, watermark=0.0)",
        "paged (block_size=16, watermark=0.05)"]
    assert paged["mean_running"] >= max(c["mean_running"] for c in contig)
    assert paged_wm5["num_preemptions"] <= paged_no_wm["num_preemptions"]


def test_cpu_speed_ablation_and_machine_commands(tiny_llama, tmp_path):
    """The CPU speed ablation (float32: oneDNN, C kernels and fused ops each off), the GEMM,
    roofline and scale commands, at tiny sizes."""
    doc = _run(["ablate", "--model", str(tiny_llama), "--on", "decode-heavy", "--ablations", "cpu-speed",
                "--num-requests", "3", "--prompt-tokens", "12", "--output-tokens", "6", "--no-plot", "--no-progress",
                "--kv-tokens", "4096"], tmp_path, "ablate-cpu")
    assert set(doc["systems"]) == {"prefixkv", "cpu-linear=onednn", "cpu-linear=torch", "attention=torch", "fused-ops=off",
                                   "all-off"}
    assert all(r["error"] is None for r in doc["systems"].values())
    assert doc["systems"]["all-off"]["info"]["cpu_linear"] == "torch"
    doc = _run(["gemm", "--model", str(tiny_llama), "--rows", "1,4", "--repeat-passes", "2"], tmp_path, "gemm")
    assert [r["rows"] for r in doc["results"]] == [1, 4]
    assert all(r["onednn-prepacked"]["ms"] > 0 for r in doc["results"])
    from prefixkv import cpu_ops
    if cpu_ops.gemm_available():  # --c-baseline: another version of the source beside the current one
        source = Path(cpu_ops.SOURCE).read_text()
        same, other = tmp_path / "same.c", tmp_path / "other.c"
        same.write_text(source)
        assert "#define GEMM_KB 64" in source
        other.write_text(source.replace("#define GEMM_KB 64", "#define GEMM_KB 32"))  # other sums
        for path, equal in ((same, True), (other, False)):
            doc = _run(["gemm", "--model", str(tiny_llama), "--rows", "1,5", "--repeat-passes", "1",
                        "--c-baseline", str(path)], tmp_path, "gemm-ab")
            assert [r["c_baseline_bitwise_equal"] for r in doc["results"]] == [equal, equal]
            assert all(r["c-baseline"]["ms"] > 0 and r["c-packed"]["ms"] > 0 for r in doc["results"])
    doc = _run(["roofline", "--model", str(tiny_llama), "--batch", "3", "--system-tokens", "20",
                "--question-tokens", "5", "--steps", "4", "--rounds", "2", "--kv-tokens", "4096"], tmp_path, "roof")
    assert doc["roofline_ms"] > 0 and doc["decode_step_ms_median"] > 0 and doc["weight_bytes"] > 0
    rounds = doc["by_round"]  # each round's ratio from its own bandwidth, peak and steps
    assert doc["rounds"] == len(rounds) == 2 and all(r["read_bandwidth"]["best_gbs"] > 0 for r in rounds)
    assert doc["step_over_roofline_median_round"] in [r["step_over_roofline"] for r in rounds]
    assert doc["read_bandwidth"]["best_gbs"] == max(r["read_bandwidth"]["best_gbs"] for r in rounds)
    doc = _run(["scale", "--sizes", "8", "--cached-blocks", "256", "--context-tokens", "256", "--steps", "3"],
               tmp_path, "scale")
    r = doc["results"][0]
    assert r["num_running"] == 8 and r["evictions"] > 0 and r["host_step_ms_median"] > 0


def test_kernel_ab(tiny_llama, tmp_path, tokenizer_dir):
    """``kernel-ab``: the C kernels of this checkout against another cpu_ops.c in one process. The same
    source gives the same bits; a source whose attention scales its scores by 1.001 more does not. The layer stack's call alternates between the two libraries step by step; a model the
    fused stack does not take is refused with the reason."""
    import shutil

    from prefixkv import cpu_ops
    from tiny_models import build_model

    if not cpu_ops.gemm_available():
        pytest.skip("kernel-ab needs an AVX-512 or AVX2 build of the C kernels")
    source = Path(cpu_ops.SOURCE).read_text()
    entry = "int max_blocks, int64_t nb1, float scale, int window, float softcap) {\n#if defined(VW)"
    assert source.count(entry) == 1
    same, other = tmp_path / "same.c", tmp_path / "other.c"
    same.write_text(source)
    other.write_text(source.replace(entry, entry.replace("{", "{\n    scale *= 1.001f;")))
    attention = ["kernel-ab", "--rows", "2", "--shared-tokens", "32", "--context", "200", "--prefill-rows", "3",
                 "--num-layers", "2", "--heads", "4", "--kv-heads", "2", "--flush-mb", "1", "--passes", "2"]
    for path, equal in ((same, True), (other, False)):
        doc = _run(attention + ["--baseline", str(path)], tmp_path, f"attn-{path.stem}")
        assert doc["part"] == "attention" and doc["rows"] == 6 and doc["bitwise_equal"] is equal
        assert doc["ms_per_pass"]["current"] > 0 and doc["ms_per_pass"]["baseline"] > 0
        assert doc["baseline_over_current"] > 0 and doc["machine"]["git_commit"] is not None
    model = tmp_path / "llama-d64"
    shutil.copytree(tokenizer_dir, model)
    from transformers import AutoTokenizer

    build_model(model, "llama", len(AutoTokenizer.from_pretrained(str(tokenizer_dir))), head_dim=64)
    layers = ["kernel-ab", "--part", "layers", "--batch", "3", "--system-tokens", "20", "--question-tokens", "5",
              "--warm", "1", "--passes", "2", "--baseline", str(same)]
    doc = _run(layers + ["--model", str(model)], tmp_path, "layers")
    assert doc["calls"] == {"current": 3, "baseline": 3}  # 2 timed steps each, after one untimed
    assert doc["ms_per_pass"]["current"] > 0 and doc["ms_per_pass"]["baseline"] > 0
    with pytest.raises(SystemExit, match="fused layer stack does not run here .*head_dim 16"):
        main(layers + ["--model", str(tiny_llama), "--out", str(tmp_path)])
    # more sequences than the engine's default max_num_seqs (64): every one decodes in the timed steps
    wide = ["kernel-ab", "--part", "layers", "--batch", "70", "--system-tokens", "8", "--question-tokens", "2",
            "--passes", "1", "--baseline", str(same), "--model", str(model)]
    doc = _run(wide, tmp_path, "layers-70")
    assert doc["batch"] == 70 and doc["calls"] == {"current": 2, "baseline": 2}


def test_shared_prefix_decodes_refuses_more_sequences_than_the_engine_runs_at_once(tiny_llama):
    """``bench.profile_step.shared_prefix_decodes`` (kernel-ab's and profile_step's decode batch): its
    requests never finish, so a batch over the engine's ``max_num_seqs`` would leave some waiting
    forever; it is refused by name, and a batch at the bound is prefilled and decoding."""
    from bench.profile_step import shared_prefix_decodes
    from prefixkv import LLM

    eng = LLM(model=str(tiny_llama), dtype="float32", max_num_seqs=4).engine
    with pytest.raises(ValueError, match=r"batch: 5 decodes at once need max_num_seqs >= 5 \(the engine's is 4\)"):
        shared_prefix_decodes(eng, 5, system_tokens=8, question_tokens=2)
    assert not eng.scheduler.waiting and not eng.scheduler.running  # nothing was added
    shared_prefix_decodes(eng, 4, system_tokens=8, question_tokens=2)
    running = eng.scheduler.running
    assert len(running) == 4 and all(r.num_computed_tokens >= r.num_prompt_tokens for r in running)


def test_report_makes_the_summary_plots_from_the_recorded_json(tmp_path):
    """``python -m bench report``: the plots bench/RESULTS.md's summary shows, made again from the
    JSON in bench/results/ (each a PNG; the same names RESULTS.md links)."""
    from bench.report import RESULTS_DIR, peer_runs

    assert main(["report", "--out", str(tmp_path)]) == 0
    made = sorted(p.name for p in tmp_path.iterdir())
    assert made == ["peers-zen4.png", "roofline-zen4.png", "routing-zen3.png", "serving.png", "tiers-zen4.png"]
    assert all((tmp_path / m).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for m in made)
    results_md = (RESULTS_DIR.parent / "RESULTS.md").read_text()
    assert all(f"results/summary/{m}" in results_md for m in made)
    # the summary's headline row is the recorded run's ratio
    latest = {r["stem"]: r for r in peer_runs(RESULTS_DIR) if r["commit"] == "0c1184f"}
    assert round(latest["shared-prefix-16x196-o32"]["over_vllm"], 2) == 1.39


def test_report_prints_a_recorded_http_run_and_ceiling():
    """``python -m bench.report FILE.json`` prints the table an HTTP run and a ceiling run printed
    when they were taken (their own JSON layouts, not the offline runs')."""
    import subprocess

    from bench.report import RESULTS_DIR

    http = RESULTS_DIR / "http-2026-12-06-xeon-f476b9d" / "http-cold-r3.json"
    ceiling = RESULTS_DIR / "http-ceiling-2026-12-06-xeon-f476b9d" / "ceiling-si4.json"
    old_ceiling = RESULTS_DIR / "http-ceiling-2026-12-05-zen3-1ccc4dd" / "ceiling.json"  # no CPU times recorded
    # the load generator's CPU inside its requests recorded too
    new_ceiling = RESULTS_DIR / "http-ceiling-2026-12-07-xeon-cab4f31" / "s64.json"
    proc = subprocess.run([sys.executable, "-m", "bench.report", str(http), str(ceiling), str(old_ceiling),
                           str(new_ceiling)],
                          cwd=RESULTS_DIR.parents[1], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "| cold | 16 | llama | 0.95 | 61 | 2209 / 9405 | 219.2 / 251.2 | 150.2 | 3.03x | 88% |" in out
    assert "| cold | 64 | llama | 1.05 | 67 | 5237 / 35418 | 823.3 / 944.7 | 527.2 | 3.15x | 94% |" in out
    assert "| 64 | prefixkv | 10695 | 14335 | 0.77 | 0.18 / 0.96 / 0.79 |" in out
    assert "| 64 | vllm | 4940 | 14335 | 0.35 | 0.32 / 3.07 / 0.82 |" in out
    assert "| 64 | prefixkv | 9097 | 14795 | 0.64 | 0.36 / 1.97 / 0.95 (0.37) |" in out
    assert out.count("### ") == 4 and "nan / nan / nan |" in out


def test_retention_bench_at_tiny_sizes(tiny_llama, tmp_path):
    """``python -m bench.retention``: the shared prompt's retained blocks survive the tenants' churn
    (whose 6 prompts of 16 tokens, one at a time, fill the 48-token pool twice); without retention
    nothing does."""
    from bench.retention import main as retention_main

    assert retention_main(["--model", str(tiny_llama), "--dtype", "float64", "--tenants", "6", "--rounds", "3",
                           "--system-tokens", "32", "--question-tokens", "4", "--tenant-tokens", "16",
                           "--device-blocks", "12", "--block-size", "4", "--max-num-seqs", "1", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("retention-*.json")
    s = json.loads(path.read_text())["summary"]
    assert s["no retention"]["hit_rate"] == 0
    assert s["retention"]["hit_rate"] == round(24 / 36, 3)  # the bound: half the pool, 6 of its 9 blocks


def test_salting_cost_at_tiny_sizes(tiny_llama, tmp_path):
    """``--systems prefixkv,prefixkv-salted`` (issue 45's "salting costs nothing measurable"): the
    same shared-prefix workload with and without one cache_salt on every request, repeats
    alternating which runs first; greedy outputs and prefix hits equal, a throughput ratio reported."""
    common = [a if a != "prefixkv,hf-static" else "prefixkv,prefixkv-salted" for a in COMMON]
    doc = _run(["shared-prefix", "--model", str(tiny_llama), "--repeat", "2"] + TINY["shared-prefix"] + common,
               tmp_path, "salt")
    plain, salted = doc["systems"]["prefixkv"], doc["systems"]["prefixkv-salted"]
    assert plain["error"] is None and salted["error"] is None, (plain.get("traceback"), salted.get("traceback"))
    assert salted["info"]["cache_salt"] == "bench-tenant" and "cache_salt" not in plain["info"]
    assert len(salted["repeats"]) == len(plain["repeats"]) == 2
    assert salted["prefix_hit_tokens"] == plain["prefix_hit_tokens"] >= 4 * 32  # one tenant hits as before
    assert doc["ratios"]["prefixkv-salted"]["prefixkv"] > 0
    ident = doc["output_identity"]
    assert ident["reference"] == "prefixkv" and ident["systems"]["prefixkv-salted"]["identical_fraction"] == 1.0


def test_the_salted_system_caches_under_its_salt(tiny_llama):
    from bench.systems import SALT, SystemArgs, make_system
    from bench.workloads import BenchRequest
    from prefixkv.kv.keys import cache_root

    s = make_system("prefixkv-salted", SystemArgs(model=str(tiny_llama), dtype="float64", kv_tokens=1024,
                                                   max_num_seqs=4), tiny_llama)
    s.setup()
    s.reset()
    prompt = [10 + i for i in range(33)]
    (out,) = s.run_round([BenchRequest(prompt, 2)], SimpleNamespace(update=lambda n: None))
    assert len(out[0]) == 2
    kv = s.engine.scheduler.kv
    assert kv.match_prefix(prompt + [0], touch=False, root=cache_root(SALT)).num_tokens == 32
    assert kv.match_prefix(prompt + [0], touch=False).num_tokens == 0  # not in the unsalted chain
    s.teardown()
