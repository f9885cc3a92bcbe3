"""PNG plots (matplotlib, Agg) and plain-text tables of a run's JSON; and the plots of
bench/RESULTS.md's summary, made again from the JSON in bench/results/ by ``python -m bench report``
(``python -m bench.report FILE.json ...`` prints a run's section for RESULTS.md)."""

from __future__ import annotations

import functools
import json
import re
import subprocess
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(doc: dict, path: Path) -> Path:
    """Output tokens/s per system, and prompt tokens submitted vs computed."""
    plt = _plt()
    sysres = {n: r for n, r in doc["systems"].items() if r.get("output_tokens_per_s")}
    names = list(sysres)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    tps = [sysres[n]["output_tokens_per_s"] for n in names]
    bars = ax.bar(names, tps, color="tab:blue")
    for b, v in zip(bars, tps):
        ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("output tokens / s (wall)")
    ax.set_title(f"{doc['workload']}: throughput")
    ax.tick_params(axis="x", rotation=30)
    ax = axes[1]
    x = range(len(names))
    sub = [sysres[n]["prompt_tokens_submitted"] for n in names]
    comp = [sysres[n]["prompt_tokens_computed"] for n in names]
    ax.bar([i - 0.2 for i in x], sub, width=0.4, label="submitted")
    ax.bar([i + 0.2 for i in x], comp, width=0.4, label="computed")
    ax.set_xticks(list(x), names, rotation=30)
    ax.set_ylabel("prompt tokens")
    ax.set_title("prompt tokens submitted vs computed")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_block_sweep(points: list[dict], path: Path) -> Path:
    """points: [{block_size, output_tokens_per_s, kv_util_logical, kv_util_physical}]"""
    plt = _plt()
    points = sorted(points, key=lambda p: p["block_size"])
    bs = [p["block_size"] for p in points]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(bs, [p["output_tokens_per_s"] for p in points], "o-", color="tab:blue", label="output tokens/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("output tokens / s")
    ax2 = ax.twinx()
    ax2.plot(bs, [p["kv_util_logical"] for p in points], "s--", color="tab:orange", label="KV utilization")
    ax2.set_ylabel("KV utilization (tokens held / slots)")
    ax2.set_ylim(0, 1.05)
    fig.legend(loc="lower left")
    ax.set_title("block-size sweep")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_series(xs, series: dict[str, list[float]], xlabel: str, ylabel: str, title: str, path: Path,
                logx: bool = False) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, ys in series.items():
        ax.plot(xs, ys, "o-", label=label)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _fmt(v, nd=2):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def table(doc: dict) -> str:
    """Markdown table: one row per system."""
    rows = ["| system | out tok/s (median) | out tok/s (best) | tok/CPU-s | wall s (median / best) "
            "| prompt submitted | prompt computed | hit rate | KV util | peak blocks | error |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in doc["systems"].items():
        err = (r.get("error") or "")[:80]
        rows.append(f"| {name} | {_fmt(r.get('output_tokens_per_s'))} | {_fmt(r.get('output_tokens_per_s_best'))} "
                    f"| {_fmt(r.get('output_tokens_per_cpu_s'))} "
                    f"| {_fmt(r.get('wall_s'), 1)} / {_fmt(r.get('wall_s_best'), 1)} "
                    f"| {_fmt(r.get('prompt_tokens_submitted'))} "
                    f"| {_fmt(r.get('prompt_tokens_computed'))} | {_fmt(r.get('prefix_hit_rate'), 3)} "
                    f"| {_fmt(r.get('kv_util_logical'), 3)} | {_fmt(r.get('peak_blocks_in_use'))} | {err} |")
    return "\n".join(rows)


def ratio_table(doc: dict, key: str = "ratios") -> str:
    rat = doc.get(key) or {}
    names = list(rat)
    rows = ["| (row / column) | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for a in names:
        rows.append(f"| {a} | " + " | ".join("1" if a == b else _fmt(rat[a].get(b)) for b in names) + " |")
    return "\n".join(rows)


def markdown(doc: dict) -> str:
    """A run's section for RESULTS.md: command, conditions, table, ratios, identity."""
    m = doc.get("machine", {})
    lines = [f"`{doc.get('command')}`", "",
             f"{m.get('cpu')}, {m.get('cpu_count')} cores, torch {m.get('torch')} ({m.get('torch_threads')} threads), "
             f"transformers {m.get('transformers')}, commit {m.get('git_commit')}; {doc.get('repeat')} repeat(s), "
             f"median; load average {doc.get('loadavg_start')} -> {doc.get('loadavg_end')}; "
             f"run took {doc.get('duration_s')} s.", "", table(doc), "",
             "Output tokens/s ratios, best of repeats (row / column):", "", ratio_table(doc, "ratios_best"), "",
             "Output tokens/s ratios, median of repeats (row / column):", "", ratio_table(doc), ""]
    ident = (doc.get("output_identity") or {}).get("systems")
    if ident:
        lines.append(f"Greedy outputs identical to {doc['output_identity']['reference']}: "
                     + ", ".join(f"{k} {v['identical_fraction']:.0%}" for k, v in ident.items()) + ".")
        lines.append("")
    canaries = {n: [r.get("canary_gflops") for r in res.get("repeats", [])] for n, res in doc["systems"].items()}
    if any(any(c) for c in canaries.values()):
        lines.append("Canary matmul GFLOP/s before each turn (contention check): "
                     + "; ".join(f"{n} {c}" for n, c in canaries.items()) + ".")
        lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------------- RESULTS.md's summary
# the peer suite's workloads (bench/cpu_peer.sh): JSON stem -> label
PEER_WORKLOADS = {"shared-prefix-16x196-o32": "shared-prefix 16x196, 32 new",
                  "shared-prefix-16x196-o128": "shared-prefix 16x196, 128 new",
                  "multi-turn-8x4": "multi-turn 8x4", "decode-heavy-16x256": "decode-heavy 16x256",
                  "cold-16": "cold 16", "parallel-sampling-8x4": "parallel sampling 8x4"}
_COMMIT = re.compile(r"(?:^|-)([0-9a-f]{7})(?:-|$)")


def _commit_of(path: Path) -> str:
    """A result file's commit: in its stem (``roofline-53fad47-run1``), else its directory's name
    (``cpu-2026-12-05-zen4-c8b514b``)."""
    for name in (path.stem, path.parent.name):
        m = _COMMIT.search(name)
        if m:
            return m.group(1)
    return "?"


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _plt().close(fig)
    return path


def _grouped_bars(ax, rows: list[dict], series: tuple[tuple[str, str], ...], cap: float | None = None) -> None:
    """One bar per (key, label) of ``series`` for each row, side by side, and the line at 1."""
    width = 0.8 / len(series)
    for k, (key, label) in enumerate(series):
        vals = [r[key] if cap is None else min(r[key], cap) for r in rows]
        ax.bar([i + (k - (len(series) - 1) / 2) * width for i in range(len(rows))], vals, width=width, label=label)
    ax.axhline(1.0, color="grey", lw=0.8)


@functools.cache
def _commit_time(commit: str) -> str:
    """The commit's date (ISO), for ordering runs whose JSON has no start time ("" where git cannot say)."""
    try:
        return subprocess.run(["git", "show", "-s", "--format=%cI", commit], capture_output=True, text=True,
                              cwd=RESULTS_DIR, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def peer_runs(results: Path, machine: str = "zen4") -> list[dict]:
    """Every run of a peer-suite workload with vLLM's CPU build on ``machine`` (its directory names
    say which), in the order they started: workload, commit, prefixkv / vLLM and / transformers."""
    rows = []
    for f in results.glob(f"cpu-peer-*-{machine}-*/*.json"):
        if f.stem not in PEER_WORKLOADS:
            continue
        doc = json.loads(f.read_text())
        ratios = doc.get("ratios", {}).get("prefixkv", {})
        vllm = next((v for k, v in ratios.items() if k.startswith("vllm")), None)
        if vllm is None:
            continue
        rows.append(dict(started=doc.get("started", ""), commit=doc["machine"]["git_commit"], stem=f.stem,
                         workload=PEER_WORKLOADS[f.stem], over_vllm=vllm, over_hf_static=ratios.get("hf-static"),
                         path=f))
    return sorted(rows, key=lambda r: r["started"])


def plot_peers(results: Path, path: Path, machine: str = "zen4") -> Path:
    """Left: the latest full suite, prefixkv over vLLM's CPU build and over transformers (static
    batch), per workload. Right: prefixkv over vLLM in every run on the machine, by commit."""
    plt = _plt()
    rows = peer_runs(results, machine)
    last = {}
    for r in rows:  # the latest directory that holds every workload
        last.setdefault(r["path"].parent, {})[r["stem"]] = r
    full = [d for d, runs in last.items() if len(runs) == len(PEER_WORKLOADS)]
    latest = max(full, key=lambda d: max(r["started"] for r in last[d].values()))
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8), gridspec_kw={"width_ratios": [1, 1.4]})
    ax = axes[0]
    stems = list(PEER_WORKLOADS)
    x = range(len(stems))
    runs = last[latest]
    for off, key, label in ((-0.2, "over_vllm", "÷ vLLM CPU"), (0.2, "over_hf_static", "÷ transformers static")):
        vals = [runs[s][key] or 0 for s in stems]
        bars = ax.bar([i + off for i in x], vals, width=0.4, label=label)
        for b, v in zip(bars, vals):
            ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(list(x), [PEER_WORKLOADS[s] for s in stems], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("prefixkv output tokens/s ÷ peer's")
    ax.set_title(f"{latest.name}: medians of 3")
    ax.legend(fontsize=8)
    ax = axes[1]
    commits = list(dict.fromkeys(r["commit"] for r in rows))
    for stem in stems:
        pts = [(commits.index(r["commit"]), r["over_vllm"]) for r in rows if r["stem"] == stem]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=PEER_WORKLOADS[stem], ms=4)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(commits)), commits, rotation=60, fontsize=7)
    ax.set_ylabel("prefixkv ÷ vLLM CPU (block 32)")
    ax.set_title(f"every run on {machine}, by commit")
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, path)


def roofline_runs(results: Path, machine: str = "zen4") -> list[dict]:
    """Every ``bench roofline`` JSON on ``machine``: commit, median round's and whole run's ratio."""
    rows = []
    for f in sorted(results.glob(f"*-{machine}-*/roofline*.json")):
        doc = json.loads(f.read_text())
        if "step_over_roofline_median_round" not in doc:
            continue
        rows.append(dict(commit=_commit_of(f), path=f, median_round=doc["step_over_roofline_median_round"],
                         whole_run=doc["step_over_roofline"]))
    return rows


def plot_roofline(results: Path, path: Path, machine: str = "zen4") -> Path:
    plt = _plt()
    order = sorted(roofline_runs(results, machine), key=lambda r: (_commit_time(r["commit"]), r["path"].stem))
    fig, ax = plt.subplots(figsize=(11, 4))
    x = range(len(order))
    ax.plot(x, [r["median_round"] for r in order], "o", label="median round (the bench's figure)")
    ax.plot(x, [r["whole_run"] for r in order], "x", label="whole run (best bandwidth and peak of any round)")
    ax.axhline(1.5, color="tab:red", lw=0.8, ls="--", label="1.5x")
    ax.set_xticks(list(x), [r["commit"] for r in order], rotation=60, fontsize=7)
    ax.set_ylabel("decode step ÷ roofline (batch 16)")
    ax.set_title(f"python -m bench roofline on {machine}, every run by commit")
    ax.legend(fontsize=8)
    return _save(fig, path)


def tier_runs(results: Path, machine: str = "zen4") -> list[dict]:
    """``bench.tiers`` runs on ``machine`` with 8 users at once: the TTFT p50 speedups over recompute
    and the admission cap they ran with."""
    rows = []
    for f in sorted(results.glob(f"cpu-*-{machine}-*/tiers-*.json")):
        doc = json.loads(f.read_text())
        if doc["params"].get("concurrency") != 8:
            continue
        s = doc["summary"]
        rows.append(dict(commit=doc["machine"]["git_commit"], path=f,
                         cap=str(doc["params"].get("max_admitted_prefill_tokens")),
                         host=s["returning_ttft_p50_speedup_host"], disk=s["returning_ttft_p50_speedup_disk"],
                         restart=s["restart_first_turn_ttft_p50_speedup"]))
    return sorted(rows, key=lambda r: (_commit_time(r["commit"]), r["path"].stem))


def plot_tiers(results: Path, path: Path, machine: str = "zen4") -> Path:
    plt = _plt()
    rows = tier_runs(results, machine)
    fig, ax = plt.subplots(figsize=(12, 4.2))
    _grouped_bars(ax, rows, (("host", "returning turn, host tier"), ("disk", "returning turn, disk tier"),
                             ("restart", "first turn after a restart (disk)")))
    ax.set_xticks(range(len(rows)), [f"{r['commit']}\ncap {r['cap']}" for r in rows], rotation=60, fontsize=6)
    ax.set_ylabel("TTFT p50: recompute ÷ tier")
    ax.set_title(f"python -m bench.tiers, 40 conversations x 4 turns, 8 users at once ({machine}), every run")
    ax.legend(fontsize=8)
    return _save(fig, path)


def routing_runs(results: Path) -> list[dict]:
    """``bench ray-routing`` runs: cache_aware over power_of_two (hit rate, TTFT p50, throughput)."""
    rows = []
    for f in results.glob("ray-routing-*/run*.json"):
        doc = json.loads(f.read_text())
        r = doc["ratios_vs_power_of_two"].get("cache_aware")
        if r is None:
            continue
        rows.append(dict(run=int(re.match(r"run(\d+)", f.stem).group(1)), commit=doc["machine"]["git_commit"],
                         path=f, hit=r["hit_rate_x"], ttft_p50=r["ttft_p50_x_better"], throughput=r["throughput_x"]))
    return sorted(rows, key=lambda r: r["run"])


def plot_routing(results: Path, path: Path) -> Path:
    plt = _plt()
    rows = routing_runs(results)
    fig, ax = plt.subplots(figsize=(11, 4))
    _grouped_bars(ax, rows, (("hit", "prefix hit rate"), ("ttft_p50", "TTFT p50 (x better)"),
                             ("throughput", "throughput")), cap=6.0)
    ax.set_xticks(range(len(rows)), [f"run {r['run']}\n{r['commit']}" for r in rows], fontsize=7)
    ax.set_ylabel("cache_aware ÷ power_of_two (capped at 6)")
    ax.set_title("python -m bench ray-routing: prefixkv's cache-aware router against Serve's default, 2 replicas")
    ax.legend(fontsize=8)
    return _save(fig, path)


def summary_plots(results: Path = RESULTS_DIR, out: Path | None = None) -> list[Path]:
    """Every plot of RESULTS.md's summary, from the JSON under ``results``, into ``out``
    (default ``results/summary``)."""
    from bench.serving import plot_serving

    out = out or results / "summary"
    out.mkdir(parents=True, exist_ok=True)
    return [plot_peers(results, out / "peers-zen4.png"), plot_roofline(results, out / "roofline-zen4.png"),
            plot_tiers(results, out / "tiers-zen4.png"), plot_routing(results, out / "routing-zen3.png"),
            plot_serving(json.loads((results / "serving-smollm2.json").read_text()), out / "serving.png")]


def cmd_report(args, command: str) -> int:
    for p in summary_plots(Path(args.results), Path(args.out) if args.out else None):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    import sys

    for f in sys.argv[1:]:
        doc = json.loads(Path(f).read_text())
        print(f"### {Path(f).stem}\n")
        words = str(doc.get("command", "")).split()  # "python -m bench SUBCOMMAND ..."
        subcommand = words[3] if words[:3] == ["python", "-m", "bench"] and len(words) > 3 else None
        if subcommand in ("http", "http-ceiling"):  # their own JSON layouts
            from bench import serve_ceiling, serve_peers

            (serve_peers if subcommand == "http" else serve_ceiling).print_summary(doc)
        else:
            print(markdown(doc))
