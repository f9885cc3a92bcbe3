"""(nineteenth session) S=8 Q=31 CTX=900 PYTHONPATH=. .venv/bin/python bench/results/cpu-2026-12-04-zen4-19th/prefill_attn.py [OTHER.c ...]
The prefill attention kernel alone on returning turns' shape: S sequences, each Q new query tokens
after CTX cached ones (SmolLM2: 9 heads, 3 KV heads, head dim 64, 16-token blocks), 30 layers of
their own KV; ms per 30 layers and GFLOP/s (QK and PV FLOPs), against other builds of cpu_ops.c."""
import os, pathlib, statistics, sys, time
import torch
from prefixkv import cpu_ops as co
torch.set_num_threads(2)
S, Q, CTX = int(os.environ.get("S", 8)), int(os.environ.get("Q", 31)), int(os.environ.get("CTX", 900))
H, KVH, D, BS = 9, 3, 64, 16
nbper = (CTX + Q + BS - 1) // BS
nblocks = S * nbper + 8
g = torch.Generator().manual_seed(0)
layers = [torch.randn(2, nblocks + 1, KVH, BS, D, generator=g) * 0.5 for _ in range(30)]
perm = torch.randperm(nblocks, generator=g)
tables = torch.stack([perm[s * nbper:(s + 1) * nbper].to(torch.int32) for s in range(S)]).contiguous()
lens = torch.full((S,), CTX + Q, dtype=torch.int32)
qsl = torch.arange(0, (S + 1) * Q, Q, dtype=torch.int32)
q = torch.randn(S * Q, H, D, generator=g)
libs = {"cur": co.load()}
for a in sys.argv[1:]:
    libs[pathlib.Path(a).stem] = co.load_source(pathlib.Path(a))
T = {k: [] for k in libs}; res = {}
for r in range(int(os.environ.get("ROUNDS", 5))):
    for name, lib in libs.items():
        out = torch.empty(S * Q, H, D)
        t0 = time.perf_counter()
        for kv in layers:
            ok = lib.paged_prefill_attention_f32(q.data_ptr(), q.stride(0), kv.data_ptr(), tables.data_ptr(), lens.data_ptr(),
                                                 qsl.data_ptr(), out.data_ptr(), S, H, KVH, D, BS, nbper, nblocks + 1,
                                                 D ** -0.5, 0, 0.0)
            assert ok
        T[name].append(time.perf_counter() - t0); res[name] = out
flops = 30 * S * H * sum(CTX + i + 1 for i in range(Q)) * D * 4
print(" ".join(f"{k} {statistics.median(v)*1e3:.1f} ms ({flops/statistics.median(v)/1e9:.1f} GFLOP/s)"
               + ("" if torch.equal(res[k], res["cur"]) else f" DIFFERENT max {(res[k]-res['cur']).abs().max().item():.2e}")
               for k, v in T.items()))
