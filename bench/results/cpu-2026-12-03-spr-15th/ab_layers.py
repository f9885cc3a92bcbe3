"""(fifteenth session) .venv/bin/python bench/results/cpu-2026-12-03-spr-15th/ab_layers.py BASE.c [rounds] [batch]: the fused layer stack's decode call with the current kernels vs BASE.c,
alternating every step in one process (batch B, 196 shared + 32 own). Prints medians of the layer call.
(Twenty-first session: WARM=N runs N decode steps first, for longer contexts; default 0.)"""
import os, sys, time, statistics, torch, ctypes
from pathlib import Path
from prefixkv import cpu_ops as co
from prefixkv import LLM, SamplingParams
from prefixkv.model import fused_stack
torch.set_num_threads(2)
base = co.load_source(Path(sys.argv[1]))
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 60
B = int(sys.argv[3]) if len(sys.argv) > 3 else 16
fns = {"current": co.load().decoder_layers_f32, "base": base.decoder_layers_f32}
T = {k: [] for k in fns}
cur = ["current"]
orig = fused_stack.FusedStack.__call__
def call(self, *a, **k):
    self.fn = fns[cur[0]]
    t0 = time.perf_counter(); r = orig(self, *a, **k); T[cur[0]].append(time.perf_counter() - t0); return r
fused_stack.FusedStack.__call__ = call
llm = LLM(); eng = llm.engine
shared = [3 + (i * 7919) % 40000 for i in range(196)]
for i in range(B):
    eng.add_request(f"r{i}", shared + [5 + (i * 31 + k) % 40000 for k in range(32)],
                    SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True))
while eng.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running):
    eng.step()
for _ in range(int(os.environ.get("WARM", 0))):
    eng.step()
for k in T: T[k].clear()
for i in range(rounds):
    cur[0] = "current" if i % 2 == 0 else "base"
    eng.step()
m = {k: statistics.median(v) * 1e3 for k, v in T.items()}
print(f"layers at batch {B}: current {m['current']:.2f} ms, base {m['base']:.2f} ms, base/current {m['base']/m['current']:.3f}")
