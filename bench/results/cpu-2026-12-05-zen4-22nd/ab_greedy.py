"""(twenty-second session) PYTHONPATH=. .venv/bin/python bench/results/cpu-2026-12-05-zen4-22nd/ab_greedy.py
A batch-16 decode step (196 shared + 32 own tokens each) with the greedy tokens from the C LM head
(cpu_ops.lm_head_argmax) and through logits + sample(), alternating step by step in one process
(WARM=N decode steps first; N=steps)."""
import os, time, statistics
from prefixkv import LLM
from bench.profile_step import shared_prefix_decodes
from prefixkv.model.llama import LlamaModel
llm = LLM(); eng = llm.engine
flag = [True]
orig = LlamaModel.greedy_head_ok
LlamaModel.greedy_head_ok = property(lambda self: flag[0] and orig.fget(self))
shared_prefix_decodes(eng)
for _ in range(int(os.environ.get("WARM", 0))): eng.step()
T = {True: [], False: []}
for i in range(int(os.environ.get("N", 100))):
    flag[0] = i % 2 == 0
    t = time.perf_counter(); eng.step(); T[flag[0]].append(time.perf_counter() - t)
a, b = statistics.median(T[True]) * 1e3, statistics.median(T[False]) * 1e3
print(f"step: fused greedy head {a:.2f} ms, logits + sample {b:.2f} ms, saved {b - a:.2f} ms ({(b - a) / b:.1%})")
