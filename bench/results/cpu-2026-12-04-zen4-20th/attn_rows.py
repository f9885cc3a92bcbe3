"""(twentieth session) PYTHONPATH=. .venv/bin/python bench/results/cpu-2026-12-04-zen4-20th/attn_rows.py
The batch-invariant attention of one layer on SmolLM2's shapes (9 heads, 3 kv heads, D 64, block 16):
a wave's prefill (S sequences x Q new tokens over CTX cached, every token a decode row of its own, as
the engine runs it) and a decode step (16 rows at CTX), timed per call (median of 30) x 30 layers."""
import os, statistics, time
import torch
torch.set_num_threads(2)
from prefixkv import cpu_ops
S, Q, CTX = int(os.environ.get("S", 8)), int(os.environ.get("Q", 31)), int(os.environ.get("CTX", 900))
H, KVH, D, BS = 9, 3, 64, 16
gen = torch.Generator().manual_seed(0)
nb = (CTX + Q + BS - 1) // BS
cache = torch.randn((2, 16 * nb + 1, KVH, BS, D), generator=gen)
perm = torch.randperm(16 * nb, generator=gen).to(torch.int32)
def timed(q, tables, lens):
    ts = []
    for _ in range(30):
        t0 = time.perf_counter()
        cpu_ops.paged_decode_attention(q, cache, tables, lens, D ** -0.5)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 30 * 1e3
tables = torch.stack([perm[s * nb:(s + 1) * nb] for s in range(S) for _ in range(Q)]).contiguous()
lens = torch.tensor([CTX + i + 1 for s in range(S) for i in range(Q)], dtype=torch.int32)
q = torch.randn((S * Q, H, D), generator=gen)
print(f"prefill rows S={S} Q={Q} CTX={CTX}: {timed(q, tables, lens):.1f} ms / 30 layers")
dt = torch.stack([perm[s * nb:(s + 1) * nb] for s in range(16)]).contiguous()
dl = torch.full((16,), CTX, dtype=torch.int32)
print(f"decode rows B=16 CTX={CTX}: {timed(torch.randn((16, H, D), generator=gen), dt, dl):.2f} ms / 30 layers")
