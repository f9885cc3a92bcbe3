"""PNG plots (matplotlib, Agg) and plain-text tables of a run's JSON."""

from __future__ import annotations

from pathlib import Path


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


if __name__ == "__main__":
    import json
    import sys

    for f in sys.argv[1:]:
        print(f"### {Path(f).stem}\n")
        print(markdown(json.loads(Path(f).read_text())))
