"""(twenty-first session) PYTHONPATH=. .venv/bin/python bench/results/cpu-2026-12-05-zen4-21st/attn_ab.py OTHER.c [CTX] [PASSES]
The decode attention of S (16) rows, each SH (196) shared tokens + its own up to CTX, over 30 layers,
each layer its own part of one huge-page cache, 18 MB read between layers as the weights are (JUNK=0:
not; HOT=1: every layer the same cache, so in L3), with the library built from this checkout against
one built from OTHER.c, alternating pass by pass; medians of the 30-layer totals. Q=31 SH=0 S=8: a
wave's prefill (each sequence Q consecutive rows, as the batch-invariant mode runs a prefill).
Before/after a change: git show REV:prefixkv/csrc/cpu_ops.c > /tmp/old.c and pass /tmp/old.c."""
import sys, statistics, time, ctypes, os
from pathlib import Path
import torch
torch.set_num_threads(2)
from prefixkv import cpu_ops
var = cpu_ops.load_source(Path(sys.argv[1]))
cur = cpu_ops.load()
CTX = int(sys.argv[2]) if len(sys.argv) > 2 else 300
P = int(sys.argv[3]) if len(sys.argv) > 3 else 20
L, B, H, KVH, D, BS, SH = 30, int(os.environ.get('S', 16)), 9, 3, 64, 16, int(os.environ.get('SH', 196))
gen = torch.Generator().manual_seed(0)
nb = (CTX + BS - 1) // BS
shb = SH // BS
nblocks = shb + B * (nb - shb) + 1
from prefixkv import hugepages
big = hugepages.empty((L, 2, nblocks + 1, KVH, BS, D), dtype=torch.float32).copy_(torch.randn((L, 2, nblocks + 1, KVH, BS, D), generator=gen)); caches = [big[l] for l in range(L)]
if os.environ.get("HOT"): caches = [big[0]] * L
perm = torch.randperm(nblocks, generator=gen).to(torch.int32)
rows = []
for b in range(B):
    rows.append(torch.cat([perm[:shb], perm[shb + b * (nb - shb): shb + (b + 1) * (nb - shb)]]))
Q = int(os.environ.get("Q", 1))
tables = torch.stack([r for r in rows for _ in range(Q)]).contiguous()
lens = torch.tensor([CTX - Q + 1 + i for _ in rows for i in range(Q)], dtype=torch.int32)
B = B * Q
q = torch.randn((B, H, D), generator=gen)
import os
JUNK = int(os.environ.get("JUNK", 1))
junk = torch.ones(18 << 18)
out = {"cur": torch.empty((B, H, D)), "var": torch.empty((B, H, D))}
T = {"cur": [], "var": []}
for p in range(P * 2 + 2):
    k = "cur" if p % 2 == 0 else "var"
    lib = cur if k == "cur" else var
    tot = 0.0
    for l in range(L):
        if JUNK: junk.sum()
        t0 = time.perf_counter()
        lib.paged_decode_attention_f32(q.data_ptr(), q.stride(0), caches[l].data_ptr(), tables.data_ptr(), lens.data_ptr(),
                                       out[k].data_ptr(), B, H, KVH, D, BS, tables.shape[1], nblocks + 1,
                                       ctypes.c_float(D ** -0.5), 0, ctypes.c_float(0.0))
        tot += time.perf_counter() - t0
    if p >= 2: T[k].append(tot)
print("AnonHuge kB", sum(int(l.split()[1]) for l in open("/proc/self/smaps") if l.startswith("AnonHugePages")))
same = torch.equal(out["cur"], out["var"])
m = {k: statistics.median(v) * 1e3 for k, v in T.items()}
print(f"ctx {CTX}: this checkout {m['cur']:.2f} ms, {sys.argv[1]} {m['var']:.2f} ms, other/this {m['var']/m['cur']:.3f}, "
      f"bitwise equal {same}")
