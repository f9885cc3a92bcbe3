"""(sixteenth session) PYTHONPATH=. .venv/bin/python bench/results/cpu-2026-12-04-zen4-16th/prefill_steps.py [loop|fused]:
the shared-prefix O32 workload's two prefill steps (the bench's prompts, 3 rounds, the prefix cache
reset between them), each step's time and, with `loop` (the layers as a Python loop), each C
kernel's share; `fused` times the steps as they run by default (the layers in one C call)."""
import sys, time, torch
torch.set_num_threads(2)
from prefixkv import LLM, SamplingParams
from bench import workloads as wl
from bench.corpus import TokenStream
from bench.profile_step import time_kernels
llm = LLM(block_size=16, max_num_batched_tokens=512, max_num_seqs=64)
eng = llm.engine
pb = wl.PromptBuilder(eng.tokenizer, TokenStream.build(eng.tokenizer))
reqs = wl.shared_prefix(pb, 1, 16, 196, 32, 32, 0).rounds[0]
spent = time_kernels(eng) if (sys.argv[1] if len(sys.argv) > 1 else "loop") == "loop" else {}
for rnd in range(3):
    eng.scheduler.kv.reset_cache()
    for i, r in enumerate(reqs):
        eng.add_request(f"x{rnd}-{i}", r.prompt, SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True))
    for s in range(2):
        spent.clear()
        t0 = time.perf_counter(); eng.step(); dt = time.perf_counter() - t0
        print(f"round {rnd} step {s}: {dt*1e3:.1f} ms; " + ", ".join(f"{k} {v*1e3:.1f}" for k, v in sorted(spent.items(), key=lambda x: -x[1])))
    while eng.has_unfinished(): eng.step()
