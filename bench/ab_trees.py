"""Same bits and the same speed at two source trees: one greedy ``python -m bench`` workload on
prefixkv alone, run at tree A and at tree B in turn (A B B A A B ...), each run a process of its own
on that tree's code. Reported per tree: every run's output tokens/s and their median, the B / A
ratio of the medians, and whether every run of both trees gave the same output tokens (a SHA-256
of them all).

    python -m bench.ab_trees --a /work/main --b . --rounds 3 -- shared-prefix --groups 1 \\
        --per-group 16 --system-tokens 196 --question-tokens 32 --output-tokens 32

The workload's own flags follow ``--``, as ``python -m bench`` takes them (``--systems`` is
prefixkv). On a shared machine alternate, repeat and read medians; say that it was shared.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _child(out: str, workload_argv: list[str]) -> int:
    """Run the workload once on the tree this process imports (PYTHONPATH) and write its figures."""
    from bench.__main__ import build_parser
    from bench.cli_impl import build_workload, engine_args, load_tokenizer
    from bench.run import run_systems
    from bench.systems import make_system

    args = build_parser().parse_args(workload_argv)
    path, tok = load_tokenizer(args.model)
    w = build_workload(args.workload, args, tok)
    results, outputs = run_systems(w, [make_system("prefixkv", engine_args(args), path)], repeat=1, progress=False)
    res = results["prefixkv"]
    digest = hashlib.sha256(json.dumps(outputs["prefixkv"]).encode()).hexdigest()
    Path(out).write_text(json.dumps(dict(output_tokens_per_s=res.get("output_tokens_per_s"), error=res.get("error"),
                                         outputs_sha256=digest, greedy=w.greedy)))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        return _child(argv[1], argv[3:] if argv[2:3] == ["--"] else argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", required=True, help="tree A (a checkout's root)")
    p.add_argument("--b", required=True, help="tree B")
    p.add_argument("--rounds", type=int, default=3, help="runs per tree")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    if "--" not in argv:
        p.parse_args(argv)  # (--help)
        p.error("the workload's flags go after --")
    k = argv.index("--")
    a, workload = p.parse_args(argv[:k]), argv[k + 1:]
    trees = {"A": str(Path(a.a).resolve()), "B": str(Path(a.b).resolve())}
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    order = [t for i in range(a.rounds) for t in (("A", "B") if i % 2 == 0 else ("B", "A"))]
    with tempfile.TemporaryDirectory() as tmp:
        for i, t in enumerate(order):
            out = os.path.join(tmp, f"{i}.json")
            env = dict(os.environ, PYTHONPATH=trees[t])
            subprocess.run([sys.executable, __file__, "--child", out, "--", *workload, "--systems", "prefixkv"],
                           cwd=trees[t], env=env, check=True)
            r = json.loads(Path(out).read_text())
            runs[t].append(r)
            print(f"{t} ({trees[t]}): {r['output_tokens_per_s']} tok/s, outputs {r['outputs_sha256'][:12]}", flush=True)
    med = {t: statistics.median(r["output_tokens_per_s"] for r in rs) for t, rs in runs.items()}
    same = len({r["outputs_sha256"] for rs in runs.values() for r in rs}) == 1
    summary = dict(workload=workload, trees=trees, order=order, median_tok_s=med, b_over_a=round(med["B"] / med["A"], 3),
                   runs={t: [r["output_tokens_per_s"] for r in rs] for t, rs in runs.items()}, outputs_identical=same,
                   loadavg=os.getloadavg(), time=time.strftime("%Y-%m-%dT%H:%M:%S"))
    print(json.dumps(summary))
    if a.out:
        Path(a.out).write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
