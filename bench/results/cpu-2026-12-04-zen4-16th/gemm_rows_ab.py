"""(sixteenth session) .venv/bin/python bench/results/cpu-2026-12-04-zen4-16th/gemm_rows_ab.py M [VARIANT.c ...]:
the C GEMM on SmolLM2's 30 layers' four weight shapes at M rows, streaming (120 distinct packed
weights, 424 MB) and in cache (one layer's four, repeated 30 times), the built kernel against each
variant source, medians of 15 rounds; says DIFFERENT where a variant's bits differ."""
import sys, time, statistics, torch
from pathlib import Path
from prefixkv import cpu_ops as co
torch.set_num_threads(2)
M = int(sys.argv[1]) if len(sys.argv) > 1 else 16
libs = {"cur": None}
for a in sys.argv[2:]:
    libs[Path(a).stem] = co.load_source(Path(a))
g = torch.Generator().manual_seed(0)
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
W = [[torch.randn(n, k, generator=g) * 0.05 for (n, k) in shapes] for _ in range(30)]
flops = sum(2 * M * n * k for n, k in shapes) * 30
nbytes = sum(4 * n * k for n, k in shapes) * 30
calls = {name: [[co.gemm_caller(co.gemm_pack(w, lib), w.shape[0], lib=lib) for w in ws] for ws in W] for name, lib in libs.items()}
xs = {k: torch.randn(M, k, generator=g) for k in (576, 1536)}
res = {}
T = {n: {"stream": [], "cache": []} for n in libs}
for r in range(15):
    for name in libs:
        c = calls[name]
        t0 = time.perf_counter()
        for layer in c:
            for (n, k), f in zip(shapes, layer):
                y = f(xs[k])
        T[name]["stream"].append(time.perf_counter() - t0)
        res[name] = y
        t0 = time.perf_counter()
        for _ in range(30):
            for (n, k), f in zip(shapes, c[0]):
                y = f(xs[k])
        T[name]["cache"].append(time.perf_counter() - t0)
for name in libs:
    s, cc = statistics.median(T[name]["stream"]), statistics.median(T[name]["cache"])
    print(f"{name}: M={M} stream {s*1e3:.2f} ms ({flops/s/1e9:.0f} GFLOP/s, {nbytes/s/1e9:.1f} GB/s)  in-cache {cc*1e3:.2f} ms ({flops/cc/1e9:.0f} GFLOP/s)"
          + ("" if torch.equal(res[name], res["cur"]) else " DIFFERENT"))
