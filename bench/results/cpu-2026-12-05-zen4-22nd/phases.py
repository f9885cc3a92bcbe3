"""(twenty-second session) python3 bench/results/cpu-2026-12-05-zen4-22nd/make_phases.py > /tmp/phases.c;
PYTHONPATH=. [WARM=N] .venv/bin/python bench/results/cpu-2026-12-05-zen4-22nd/phases.py /tmp/phases.c [steps] [batch]
The fused layer stack's time by phase (each thread's wall time between the phases of decoder_layers_f32,
barriers included) over batch-B decode steps (196 shared + 32 own tokens), then the 1 GiB read bandwidth."""
import os, sys, time, statistics, torch, ctypes
from pathlib import Path
from prefixkv import cpu_ops as co
from prefixkv import LLM
from bench.profile_step import shared_prefix_decodes
from prefixkv.model import fused_stack
torch.set_num_threads(2)
lib = co.load_source(Path(sys.argv[1]))
N = int(sys.argv[2]) if len(sys.argv) > 2 else 60
B = int(sys.argv[3]) if len(sys.argv) > 3 else 16
orig = fused_stack.FusedStack.__call__
def call(self, *a, **k):
    self.fn = lib.decoder_layers_f32
    return orig(self, *a, **k)
fused_stack.FusedStack.__call__ = call
llm = LLM(); eng = llm.engine
shared_prefix_decodes(eng, B)
for _ in range(int(os.environ.get("WARM", 0))): eng.step()
buf = (ctypes.c_double * 64)()
lib.phase_get(buf)
t0 = time.perf_counter()
for _ in range(N): eng.step()
wall = (time.perf_counter() - t0) / N
lib.phase_get(buf)
names = ["norm1", "qkv", "bar", "rope+kvw", "attn", "o", "bar", "norm2", "gate_up", "bar", "silu", "down", "bar"]
print(f"step {wall*1e3:.2f} ms; per step, thread 0 / thread 1 (ms):")
tot = [0, 0]
for k, n in enumerate(names):
    a, b = buf[k] / N * 1e3, buf[32 + k] / N * 1e3
    tot[0] += a; tot[1] += b
    print(f"  {k:2d} {n:9s} {a:6.2f} {b:6.2f}")
print(f"  total     {tot[0]:6.2f} {tot[1]:6.2f}")
from bench.micro import read_bandwidth_gbs
print("read bandwidth", read_bandwidth_gbs(seconds=1.0))
