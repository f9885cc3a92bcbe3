"""(nineteenth session) PYTHONPATH=. .venv/bin/python bench/results/cpu-2026-12-04-zen4-19th/prefill_step.py
The step a wave of returning turns costs: S sequences whose first CTX tokens are cached in the
device pool each add Q new tokens, prefilled in one step (SmolLM2 fp32, the engine's own step),
against the same new tokens with no history (CTX 0: the attention over the history gone), and
the prefill attention kernel alone on that shape."""
import os, statistics, time
import torch
torch.set_num_threads(2)
from prefixkv import LLM, SamplingParams
S, Q = int(os.environ.get("S", 8)), int(os.environ.get("Q", 31))
llm = LLM(model=None, dtype="float32", num_kv_blocks=1200, max_num_batched_tokens=2048, max_num_seqs=16)
eng = llm.engine
sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
def wave(ctx, tag):
    hist = [[1 + (7 * i + 13 * s + 3 * tag) % 40000 for i in range(ctx)] for s in range(S)]
    for s, h in enumerate(hist if ctx else ()):  # the histories, cached
        eng.add_request(f"h{tag}-{s}", h, sp)
    while eng.has_unfinished():
        eng.step()
    for s, h in enumerate(hist):  # (new tokens of each wave its own: no cache hits among them)
        eng.add_request(f"w{tag}-{s}", h + [5 + (s * 11 + i + 17 * tag) % 40000 for i in range(Q)], sp)
    t0 = time.perf_counter()
    eng.step()  # the wave's one step
    dt = time.perf_counter() - t0
    while eng.has_unfinished(): eng.step()
    return dt
for ctx in (900, 0):
    ts = [wave(ctx, 100 * ctx + r) for r in range(5)]
    print(f"S={S} Q={Q} CTX={ctx}: step median {statistics.median(ts)*1e3:.0f} ms ({', '.join(f'{t*1e3:.0f}' for t in ts)})")
