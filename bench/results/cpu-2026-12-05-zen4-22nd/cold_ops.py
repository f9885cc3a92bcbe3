"""(twenty-second session) PYTHONPATH=. .venv/bin/python bench/results/cpu-2026-12-05-zen4-22nd/cold_ops.py
Three small torch ops of a decode step's forward (the embedding of 16 ids, the RoPE tables of 16
positions as computed before c8b514b, the final norm of 16 rows), warm (back to back) and after a 512 MB
read has gone through the caches, as a step's weights do between two steps."""
import time, statistics, torch
from prefixkv import LLM
m = LLM().engine.model
ids, pos = torch.arange(100, 116), torch.arange(300, 316)
h, idx = torch.randn(16, 576), torch.arange(16)
junk = torch.ones(128 << 20)
def three():
    m.model.embed_tokens(ids); m._rope_compute(pos, torch.float32, "default"); m.model.norm.add_forward(h[idx], h[idx])
def med(f, n, cold):
    ts = []
    for _ in range(n):
        if cold: junk.sum()
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6
with torch.inference_mode():
    for _ in range(50): three()
    print(f"warm {med(three, 500, False):.1f} us, after a 512 MB read {med(three, 40, True):.1f} us")
