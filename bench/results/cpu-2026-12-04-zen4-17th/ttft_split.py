"""(seventeenth session) PYTHONPATH=. .venv/bin/python bench/results/cpu-2026-12-04-zen4-17th/ttft_split.py [host|recompute]: Where a returning turn's TTFT goes with the host tier at concurrency 8 (bench.tiers' 40x4/480 blocks)."""
import statistics, sys, time, json
import torch
torch.set_num_threads(2)
from bench import tiers
from prefixkv import LLM
conv, turns, blocks, conc = 40, 4, 480, 8
host = sys.argv[1] != "recompute" if len(sys.argv) > 1 else True
order = tiers._order(conv, turns, 0)
kw = dict(model=None, dtype="float32", num_kv_blocks=blocks, max_num_batched_tokens=512, max_num_seqs=16)
if host:
    kw.update(kv_host_cache_gb=2.0)
llm = LLM(**kw); llm.generate(["warm up"], None)
eng = llm.engine
sched = eng.scheduler
log = []  # per step: (t0, dt, n_sched, n_tokens, {rid: (num_new, computed)}, waiting ids, swap_in count)
real_step = eng.step
real_sched = sched.schedule
cur = {}
def spy_sched():
    out = real_sched()
    cur["out"] = out
    return out
sched.schedule = spy_sched
def spy_step():
    t0 = time.perf_counter()
    r = real_step()
    dt = time.perf_counter() - t0
    out = cur.pop("out", None)
    if out is not None:
        log.append(dict(t0=t0, dt=dt, sched={s.req.request_id: (s.num_scheduled_tokens, s.num_computed_tokens) for s in out.scheduled},
                        ntok=out.num_batched_tokens, waiting=[r.request_id for r in sched.waiting], swap_in=len(out.swap_in), swap_out=len(out.swap_out)))
    return r
eng.step = spy_step
swap_t = []
real_swap = eng.runner.swap
def spy_swap(out):
    t0 = time.perf_counter(); real_swap(out); swap_t.append((time.perf_counter() - t0, len(out.swap_in), len(out.swap_out)))
eng.runner.swap = spy_swap
adds = {}
real_add = eng.add_request
def spy_add(rid, ids, sp):
    adds[rid] = (time.perf_counter(), len(ids))
    return real_add(rid, ids, sp)
eng.add_request = spy_add
res = tiers._run(llm, order, 64, tiers._histories(conv, 60), conc)
print({k: v for k, v in res.items() if k != "outputs"})
# per returning turn: steps from add to its first sampled token
rows = []
for rid, (ta, n) in adds.items():
    i = int(rid[1:])
    if i < conv: continue
    steps = [s for s in log if s["t0"] + s["dt"] >= ta]
    first_sched = next((k for k, s in enumerate(steps) if rid in s["sched"]), None)
    # first token: the step in which computed+new reaches n
    done = next((k for k, s in enumerate(steps) if rid in s["sched"] and sum(s["sched"][rid]) >= n), None)
    if done is None: continue
    ttft = steps[done]["t0"] + steps[done]["dt"] - ta
    wait = steps[first_sched]["t0"] - ta
    prefill = [steps[k]["sched"].get(rid, (0, 0))[0] for k in range(first_sched, done + 1)]
    rows.append(dict(ttft=ttft, wait=wait, nsteps_wait=first_sched, nsteps_prefill=done - first_sched + 1,
                     new_tokens=sum(prefill), step_ms=[round(steps[k]["dt"] * 1e3) for k in range(first_sched, done + 1)],
                     step_tok=[steps[k]["ntok"] for k in range(first_sched, done + 1)]))
rows.sort(key=lambda r: r["ttft"])
med = rows[len(rows) // 2]
print("n", len(rows), "ttft p50", round(med["ttft"] * 1e3), "ms")
print("median wait before first scheduled", round(statistics.median(r["wait"] for r in rows) * 1e3), "ms;",
      "steps waited", statistics.median(r["nsteps_wait"] for r in rows), "; prefill steps", statistics.median(r["nsteps_prefill"] for r in rows),
      "; new tokens", statistics.median(r["new_tokens"] for r in rows))
for r in rows[len(rows)//2 - 3: len(rows)//2 + 3]:
    print(round(r["ttft"]*1e3), round(r["wait"]*1e3), r["nsteps_wait"], r["new_tokens"], r["step_ms"], r["step_tok"])
print("step ms median", round(statistics.median(s["dt"] for s in log) * 1e3, 1), "tokens/step median", statistics.median(s["ntok"] for s in log))

big = [x for x in swap_t if x[1] > 20]
print("swaps", len(swap_t), "with >20 blocks in:", len(big), "median ms", round(statistics.median(x[0] for x in big) * 1e3, 1) if big else None,
      "median blocks in/out", statistics.median(x[1] for x in big) if big else None, statistics.median(x[2] for x in big) if big else None,
      "total s", round(sum(x[0] for x in swap_t), 2))
