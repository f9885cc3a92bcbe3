"""Runs one workload on several systems in the same process and writes one JSON (plus a PNG).

Timings on a shared 2-core machine are noisy, so systems are compared within one run: with
``repeat > 1`` the systems take turns (the order rotates every repeat); each system's time is
reported as the median of its repeats and as the best (minimum, the least disturbed, as timeit
does). Before each turn a fixed matmul (the "canary") measures how much of the machine is free;
``--wait-quiet S`` waits up to S seconds for it to recover before the turn starts. Output tokens
per CPU-second (process time, all threads) is reported too; under contention it exposes threads
spinning at OpenMP barriers.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

from bench.systems import System
from bench.workloads import Workload


def machine_info(threads: int) -> dict:
    import torch
    import transformers

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    try:  # the engine may be edited under a running benchmark: record what this process imported
        # (":/prefixkv" is from the repository root; a bare "prefixkv" would be relative to bench/)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", ":/prefixkv"], capture_output=True, text=True,
                               cwd=Path(__file__).resolve().parent, timeout=10).stdout.split("\n")
        dirty = [line[3:] for line in dirty if line.strip()]
    except (OSError, subprocess.SubprocessError):
        dirty = None
    return dict(cpu=cpu, cpu_count=os.cpu_count(), torch_threads=threads, torch=torch.__version__,
                transformers=transformers.__version__, python=platform.python_version(),
                platform=platform.platform(), git_commit=commit, prefixkv_uncommitted=dirty, gpu=None)


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _mean(xs) -> float | None:
    return round(statistics.fmean(xs), 4) if xs else None


def run_systems(workload: Workload, systems: list[System], repeat: int = 1, lazy: bool = False,
                progress: bool = True, max_wait_s: float = 0.0) -> tuple[dict, dict]:
    """Returns ({system name: result dict}, {system name: outputs of its first repeat}). ``lazy``: set
    each system up just before its turn and tear it down after (for many engine variants that would
    not fit in memory together)."""
    from tqdm import tqdm

    num_req = len(workload.rounds[0]) * workload.total_rounds
    results: dict[str, dict] = {s.name: dict(repeats=[], error=None, info=None) for s in systems}
    outputs: dict[str, list] = {}
    if not lazy:
        for s in systems:
            _guard(results[s.name], s.setup)
    for rep in range(repeat):
        k = rep % len(systems)
        for s in systems[k:] + systems[:k]:
            res = results[s.name]
            if res["error"]:
                continue
            if lazy and not _guard(res, s.setup):
                continue
            bar = tqdm(total=num_req, desc=f"{workload.name} {s.name} [{rep + 1}/{repeat}]", unit="req",
                       disable=not progress, leave=False, file=sys.stderr)
            ok = _guard(res, lambda: _one_repeat(workload, s, res, outputs, rep, bar, max_wait_s))
            bar.close()
            if ok and res["info"] is None:
                res["info"] = s.info()
            if lazy:
                s.teardown()
    if not lazy:
        for s in systems:
            s.teardown()
    for res in results.values():
        _summarize(res)
    return results, outputs


def _guard(res: dict, fn) -> bool:
    try:
        fn()
        return True
    except Exception as e:  # record the exact error instead of a number
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc(limit=8)[-4000:]
        print(f"bench: {res['error']}", file=sys.stderr)
        return False


def canary_gflops(seconds: float = 0.3) -> float:
    """A fixed fp32 matmul timed just before a system's turn: when other processes take the cores it
    drops, which says how much to trust that turn's time."""
    import torch

    a, b = torch.randn(256, 576), torch.randn(576, 1536)
    a @ b
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        n += 1
    return round(2 * 256 * 576 * 1536 * n / (time.perf_counter() - t0) / 1e9, 1)


_BEST_CANARY = [0.0]


def wait_quiet(max_wait_s: float, frac: float = 0.6) -> tuple[float, float]:
    """Wait (up to ``max_wait_s``) until the canary reaches ``frac`` of the best seen in this
    process, so that every system's turn starts on an equally quiet machine. Returns (canary, waited s)."""
    t0 = time.perf_counter()
    while True:
        c = canary_gflops()
        _BEST_CANARY[0] = max(_BEST_CANARY[0], c)
        waited = time.perf_counter() - t0
        if c >= frac * _BEST_CANARY[0] or waited >= max_wait_s:
            return c, round(waited, 1)
        time.sleep(5.0)


def _one_repeat(workload: Workload, s: System, res: dict, outputs: dict, rep: int, bar,
                max_wait_s: float = 0.0) -> None:
    s.reset()
    canary, waited = wait_quiet(max_wait_s)
    load = _loadavg()
    prev = prev_out = None
    all_out = []
    num_out = 0
    w0, c0 = time.perf_counter(), time.process_time()
    for t in range(workload.total_rounds):
        reqs = workload.round(t, prev, prev_out)
        outs = s.run_round(reqs, bar)
        for r, o in zip(reqs, outs):
            assert len(o) == r.n and all(len(x) == r.max_tokens for x in o), \
                f"{s.name}: expected {r.n} x {r.max_tokens} tokens, got {[len(x) for x in o]}"
            num_out += sum(len(x) for x in o)
        all_out.append(outs)
        prev, prev_out = reqs, outs
    wall = time.perf_counter() - w0 - s.counters.probe_s
    # CPU time of this process: meaningless for a peer that computes in other processes
    cpu = time.process_time() - c0 - s.counters.probe_s if getattr(s, "in_process", True) else None
    c = s.counters
    res["repeats"].append(dict(
        wall_s=round(wall, 3), cpu_s=None if cpu is None else round(cpu, 3), output_tokens=num_out,
        prompt_tokens_submitted=c.prompt_tokens_submitted, prompt_tokens_computed=c.prompt_tokens_computed,
        prefix_hit_tokens=c.prefix_hit_tokens, prefix_queried_tokens=c.prefix_queried_tokens,
        num_steps=c.num_steps, num_preemptions=c.num_preemptions,
        spec_draft_tokens=c.spec_draft_tokens, spec_accepted_tokens=c.spec_accepted_tokens,
        kv_util_logical=_mean(c.kv_util_logical), kv_util_physical=_mean(c.kv_util_physical),
        peak_blocks_in_use=max(c.blocks_in_use) if c.blocks_in_use else None,
        mean_blocks_in_use=_mean(c.blocks_in_use), canary_gflops=canary, waited_for_quiet_s=waited,
        loadavg=load))
    if rep == 0:
        outputs[s.name] = all_out


def _summarize(res: dict) -> None:
    reps = res["repeats"]
    if not reps:
        return
    wall = statistics.median(r["wall_s"] for r in reps)
    cpus = [r["cpu_s"] for r in reps if r["cpu_s"] is not None]
    cpu = statistics.median(cpus) if cpus else 0.0
    best = min(reps, key=lambda r: r["wall_s"])
    last = reps[-1]
    res.update(
        wall_s=wall, cpu_s=cpu, output_tokens=last["output_tokens"],
        output_tokens_per_s=round(last["output_tokens"] / wall, 3),
        wall_s_best=best["wall_s"], output_tokens_per_s_best=round(last["output_tokens"] / best["wall_s"], 3),
        canary_gflops_best_run=best.get("canary_gflops"),
        output_tokens_per_cpu_s=round(last["output_tokens"] / cpu, 3) if cpu > 0 else None,
        prompt_tokens_submitted=last["prompt_tokens_submitted"],
        prompt_tokens_computed=last["prompt_tokens_computed"],
        prefix_hit_tokens=last["prefix_hit_tokens"],
        prefix_hit_rate=round(last["prefix_hit_tokens"] / last["prefix_queried_tokens"], 4)
        if last["prefix_queried_tokens"] else None,
        kv_util_logical=last["kv_util_logical"], kv_util_physical=last["kv_util_physical"],
        internal_fragmentation=round(1 - last["kv_util_logical"], 4) if last["kv_util_logical"] is not None else None,
        peak_blocks_in_use=last["peak_blocks_in_use"], num_steps=last["num_steps"],
        num_preemptions=last["num_preemptions"], spec_draft_tokens=last.get("spec_draft_tokens"),
        spec_accepted_tokens=last.get("spec_accepted_tokens"))


def ratios(results: dict, key: str = "output_tokens_per_s") -> dict:
    ok = {n: r[key] for n, r in results.items() if r.get(key)}
    return {a: {b: round(ok[a] / ok[b], 3) for b in ok if b != a} for a in ok}


def identity(outputs: dict, reference: str) -> dict:
    """Fraction of sequences whose output tokens equal the reference system's (greedy workloads)."""
    ref = outputs.get(reference)
    out = {}
    if ref is None:
        return out
    flat_ref = [x for rnd in ref for req in rnd for x in req]
    for name, o in outputs.items():
        if name == reference:
            continue
        flat = [x for rnd in o for req in rnd for x in req]
        same = sum(a == b for a, b in zip(flat, flat_ref))
        first = sum(a[:1] == b[:1] for a, b in zip(flat, flat_ref))
        out[name] = dict(identical_fraction=round(same / len(flat_ref), 4),
                         first_token_fraction=round(first / len(flat_ref), 4), num_sequences=len(flat_ref))
    return out


def write_result(doc: dict, out_dir: str | Path, stem: str) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def rewrite_result(doc: dict) -> Path:
    """Write a ``run_and_report`` doc again (fields were added) to its ``json_path``, without the paths."""
    path = Path(doc["json_path"])
    return write_result({k: v for k, v in doc.items() if k not in ("json_path", "png_path")}, path.parent, path.stem)


def run_and_report(workload: Workload, systems: list[System], *, repeat: int, out_dir: str, command: str,
                   threads: int, engine_args: dict, lazy: bool = False, plot: bool = True,
                   progress: bool = True, stem: str | None = None, extra: dict | None = None,
                   max_wait_s: float = 0.0) -> dict:
    load0 = _loadavg()
    machine = machine_info(threads)
    t0 = time.time()
    results, outputs = run_systems(workload, systems, repeat=repeat, lazy=lazy, progress=progress,
                                   max_wait_s=max_wait_s)
    names = [s.name for s in systems]
    reference = "hf-static" if "hf-static" in outputs else (names[0] if names else None)
    doc = dict(
        workload=workload.name, params=workload.params, command=command, repeat=repeat,
        started=time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t0)), duration_s=round(time.time() - t0, 1),
        machine=machine, loadavg_start=load0, loadavg_end=_loadavg(),
        engine_args=engine_args, systems=results,
        ratios=ratios(results), ratios_best=ratios(results, "output_tokens_per_s_best"),
        ratios_cpu=ratios(results, "output_tokens_per_cpu_s"),
        output_identity=dict(reference=reference, greedy=workload.greedy,
                             systems=identity(outputs, reference) if workload.greedy else {}),
    )
    if extra:
        doc.update(extra)
    stem = stem or f"{workload.name}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(t0))}"
    path = write_result(doc, out_dir, stem)
    doc["json_path"] = str(path)
    if plot:
        from bench.report import plot_run

        try:
            doc["png_path"] = str(plot_run(doc, path.with_suffix(".png")))
        except Exception as e:  # a plot must never lose the numbers
            print(f"bench: plot failed: {type(e).__name__}: {e}", file=sys.stderr)
    return doc
