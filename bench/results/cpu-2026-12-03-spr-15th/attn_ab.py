"""(fifteenth session) SH=12 ROUNDS=40 .venv/bin/python bench/results/cpu-2026-12-03-spr-15th/attn_ab.py OTHER.c ...: decode attention alone: 30 layers x B seqs x L tokens, block 16, H 9 / KVH 3 / D 64; SHARED blocks common."""
import sys, time, statistics, torch
from prefixkv import cpu_ops as co
torch.set_num_threads(int(__import__("os").environ.get("THR", 2)))
B, L, SH = 16, 228, int(__import__("os").environ.get("SH", 12))
H, KVH, D, BS = 9, 3, 64, 16
nbper = (L + BS - 1) // BS
nblocks = 4096
g = torch.Generator().manual_seed(0)
layers = [torch.randn(2, nblocks + 1, KVH, BS, D, generator=g) * 0.5 for _ in range(30)]
perm = torch.randperm(nblocks, generator=g)
shared = perm[:SH].tolist(); rest = perm[SH:].tolist()
tables = torch.zeros(B, nbper, dtype=torch.int32)
for b in range(B):
    own = rest[b * (nbper - SH):(b + 1) * (nbper - SH)]
    tables[b] = torch.tensor(shared + own, dtype=torch.int32)
lens = torch.full((B,), L, dtype=torch.int32)
q = torch.randn(B, H, D, generator=g)
out = torch.empty(B, H, D)
libs = {"cur": co.load()}
for a in sys.argv[1:]:
    libs[__import__("pathlib").Path(a).stem] = co.load_source(__import__("pathlib").Path(a))
T = {k: [] for k in libs}
res = {}
for r in range(int(__import__('os').environ.get('ROUNDS', 30))):
    for name, lib in libs.items():
        fn = lib.paged_decode_attention_f32
        t0 = time.perf_counter()
        for kv in layers:
            fn(q.data_ptr(), q.stride(0), kv.data_ptr(), tables.data_ptr(), lens.data_ptr(), out.data_ptr(),
               B, H, KVH, D, BS, nbper, nblocks + 1, D ** -0.5, 0, 0.0)
        T[name].append(time.perf_counter() - t0)
        res[name] = out.clone()
print(" ".join(f"{k} {statistics.median(v)*1e3:.2f} ms" + ("" if torch.equal(res[k], res["cur"]) else " (DIFFERENT)") for k, v in T.items()))
