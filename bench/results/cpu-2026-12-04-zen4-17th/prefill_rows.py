"""(seventeenth session) S=8 R=20 CTX=1000 PYTHONPATH=. .venv/bin/python bench/results/cpu-2026-12-04-zen4-17th/prefill_rows.py [OTHER.c ...]: Decode-kernel rows of prefill tokens: S sequences x R rows each (positions ctx..ctx+R-1), 30 layers."""
import sys, time, statistics, torch, os, pathlib
from prefixkv import cpu_ops as co
torch.set_num_threads(2)
S, R, CTX = int(os.environ.get("S", 8)), int(os.environ.get("R", 20)), int(os.environ.get("CTX", 1000))
H, KVH, D, BS = 9, 3, 64, 16
nbper = (CTX + R + BS - 1) // BS
nblocks = S * nbper + 8
g = torch.Generator().manual_seed(0)
layers = [torch.randn(2, nblocks + 1, KVH, BS, D, generator=g) * 0.5 for _ in range(30)]
perm = torch.randperm(nblocks, generator=g)
tables, lens = [], []
for s in range(S):
    t = perm[s * nbper:(s + 1) * nbper].to(torch.int32)
    for i in range(R):
        tables.append(t); lens.append(CTX + i + 1)
tables = torch.stack(tables).contiguous(); lens = torch.tensor(lens, dtype=torch.int32)
B = S * R
q = torch.randn(B, H, D, generator=g)
libs = {"cur": co.load()}
for a in sys.argv[1:]:
    libs[pathlib.Path(a).stem] = co.load_source(pathlib.Path(a))
T = {k: [] for k in libs}; res = {}
for r in range(int(os.environ.get("ROUNDS", 5))):
    for name, lib in libs.items():
        out = torch.empty(B, H, D)
        t0 = time.perf_counter()
        for kv in layers:
            lib.paged_decode_attention_f32(q.data_ptr(), q.stride(0), kv.data_ptr(), tables.data_ptr(), lens.data_ptr(), out.data_ptr(), B, H, KVH, D, BS, nbper, nblocks + 1, D ** -0.5, 0, 0.0)
        T[name].append(time.perf_counter() - t0); res[name] = out
hk = sum(lens.tolist()) * H * 30
print(" ".join(f"{k} {statistics.median(v)*1e3:.1f} ms ({statistics.median(v)*2/hk*1e9:.2f} ns/head-key/thread)" + ("" if torch.equal(res[k], res["cur"]) else " DIFFERENT") for k, v in T.items()))
