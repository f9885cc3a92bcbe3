"""(twenty-second session) PYTHONPATH=. .venv/bin/python bench/results/cpu-2026-12-05-zen4-22nd/py_breakdown.py
Where a batch-16 decode step's time goes outside the C kernels (196 shared + 32 own tokens each, 100
steps after the prefill): each piece of LLMEngine.step / ModelRunner.execute / LlamaModel.forward wrapped
with a timer; "python total" is the step less the fused layer stack's and the LM head's C calls. (At
53fad47 a greedy step's LM head is cpu_ops.lm_head_argmax: then the head's time is in "forward" and the
total over-counts by it; read the pieces.)"""
import time, collections
from prefixkv import LLM, cpu_ops
from bench.profile_step import shared_prefix_decodes
from prefixkv.model import fused_stack
import prefixkv.runner.model_runner as mr
llm = LLM(); eng = llm.engine
shared_prefix_decodes(eng)
spent = collections.defaultdict(float)
def wrapf(fn, key):
    def w(*a, **k):
        t = time.perf_counter()
        try: return fn(*a, **k)
        finally: spent[key] += time.perf_counter() - t
    return w
m = eng.model
m.model.embed_tokens.forward = wrapf(m.model.embed_tokens.forward, "embed")
m.rope = wrapf(m.rope, "rope")
orig = fused_stack.FusedStack.__call__
def call(self, *a, **k):
    if not hasattr(self, "_wrapped"):
        self.fn = wrapf(self.fn, "stack_c"); self._wrapped = True
    t = time.perf_counter()
    try: return orig(self, *a, **k)
    finally: spent["stack_all"] += time.perf_counter() - t
fused_stack.FusedStack.__call__ = call
m.model.norm.add_forward = wrapf(m.model.norm.add_forward, "final_norm")
head = m.packed_lm_head
head.c_gemm = wrapf(head.c_gemm, "lm_head_c")
m.logits = wrapf(m.logits, "logits_all")
if hasattr(cpu_ops, "lm_head_argmax"):
    cpu_ops.lm_head_argmax = wrapf(cpu_ops.lm_head_argmax, "lm_head_argmax")
m.forward = wrapf(m.forward, "forward")
r = eng.runner
r.prepare = wrapf(r.prepare, "prepare")
r.sampling_batch = wrapf(r.sampling_batch, "sampling_batch")
mr.sample = wrapf(mr.sample, "sample")
r._split = wrapf(r._split, "split")
r.execute = wrapf(r.execute, "execute")
eng.scheduler.schedule = wrapf(eng.scheduler.schedule, "schedule")
eng.scheduler.update = wrapf(eng.scheduler.update, "update")
eng.output.process_tokens = wrapf(eng.output.process_tokens, "process_tokens")
eng._emit = wrapf(eng._emit, "emit")
N = 100
t0 = time.perf_counter()
for _ in range(N): eng.step()
wall = (time.perf_counter() - t0) / N
print(f"step {wall*1e3:.3f} ms")
for k, v in spent.items(): print(f"  {k:15s} {v/N*1e3:.3f}")
print(f"  python total   {(wall - (spent['stack_c'] + spent['lm_head_c'] + spent['lm_head_argmax'])/N)*1e3:.3f}")
print(f"  stack wrapper  {(spent['stack_all'] - spent['stack_c'])/N*1e3:.3f}")
