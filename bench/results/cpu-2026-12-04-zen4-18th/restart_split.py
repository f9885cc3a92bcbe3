"""(eighteenth session; the nineteenth added WAIT=seconds, the engine's disk_wait_max_s, and MNBT=, its max_num_batched_tokens; MODE=recompute runs without tiers; the twentieth MAPT=, max_admitted_prefill_tokens) PYTHONPATH=. .venv/bin/python bench/results/cpu-2026-12-04-zen4-18th/restart_split.py [BASE_DIR]
bench.tiers' restart (40x4, 480 device blocks, 0.2 GiB host above 3 GiB disk, 8 at once), taken apart:
each last turn's time from add to admission (waiting for its disk reads), the step that prefills it,
and the time the steps spend reading files into the device pool. The 'before' turns are served once
into BASE_DIR (kept; later runs copy it) so repeated runs see the same directory."""
import json, os, shutil, statistics, sys, time
import torch
torch.set_num_threads(2)
from bench import tiers
from prefixkv import LLM

conv, turns, blocks, conc = 40, 4, 480, 8
base = sys.argv[1] if len(sys.argv) > 1 else "/tmp/restart-base"
order = tiers._order(conv, turns, 0)
last = {c: max(i for i, x in enumerate(order) if x == c) for c in set(order)}
before = [c for i, c in enumerate(order) if i != last[c]]
after = [c for i, c in enumerate(order) if i == last[c]]

def make(d):
    kw = dict(model=None, dtype="float32", num_kv_blocks=blocks, max_num_batched_tokens=int(os.environ.get("MNBT", 512)), max_num_seqs=16,
              max_admitted_prefill_tokens=int(os.environ["MAPT"]) if os.environ.get("MAPT") else None)
    if d:
        kw.update(kv_host_cache_gb=0.2, kv_disk_cache_dir=d, kv_disk_cache_gb=3.0)
    llm = LLM(**kw); llm.generate(["warm up"], None)
    return llm

hist = tiers._histories(conv, 60)
if not os.path.exists(base + "/hist.json"):
    os.makedirs(base, exist_ok=True)
    first = make(base + "/kv")
    tiers._run(first, before, 64, hist, conc)
    first.close(); del first
    json.dump(hist, open(base + "/hist.json", "w"))
hist = {int(k): v for k, v in json.load(open(base + "/hist.json")).items()}
run = "/tmp/restart-run"
shutil.rmtree(run, ignore_errors=True)
shutil.copytree(base + "/kv", run)
os.system(f"cat {run}/*/* > /dev/null")  # page cache warm, as after the first run
mode = os.environ.get("MODE", "disk")
llm = make(run if mode == "disk" else None)
eng = llm.engine; sched = eng.scheduler
if "WAIT" in os.environ: eng.disk_wait_max_s = float(os.environ["WAIT"])
log = []; cur = {}
real_sched, real_step, real_swap = sched.schedule, eng.step, eng.runner.swap
def spy_sched():
    out = real_sched(); cur["out"] = out; return out
sched.schedule = spy_sched
def spy_swap(out):
    t0 = time.perf_counter(); real_swap(out); cur["swap"] = (time.perf_counter() - t0, len(out.load), len(out.swap_in))
eng.runner.swap = spy_swap
def spy_step():
    t0 = time.perf_counter(); r = real_step(); dt = time.perf_counter() - t0
    out = cur.pop("out", None)
    if out is not None:
        log.append(dict(t0=t0, dt=dt, sched={s.req.request_id: (s.num_scheduled_tokens, s.num_computed_tokens) for s in out.scheduled},
                        ntok=out.num_batched_tokens, swap=cur.pop("swap", (0, 0, 0))))
    return r
eng.step = spy_step
adds = {}
real_add = eng.add_request
def spy_add(rid, ids, sp):
    adds[rid] = (time.perf_counter(), len(ids)); return real_add(rid, ids, sp)
eng.add_request = spy_add
res = tiers._run(llm, after, 64, hist, conc)
print({k: v for k, v in res.items() if k != "outputs"})
rows = []
for rid, (ta, n) in adds.items():
    steps = [s for s in log if s["t0"] + s["dt"] >= ta]
    fs = next((k for k, s in enumerate(steps) if rid in s["sched"]), None)
    done = next((k for k, s in enumerate(steps) if rid in s["sched"] and sum(s["sched"][rid]) >= n), None)
    if done is None: continue
    rows.append(dict(rid=rid, ttft=steps[done]["t0"] + steps[done]["dt"] - ta, wait=steps[fs]["t0"] - ta, nwait=fs,
                     new=sum(steps[k]["sched"].get(rid, (0, 0))[0] for k in range(fs, done + 1)),
                     step_ms=[round(steps[k]["dt"] * 1e3) for k in range(fs, done + 1)],
                     load=[(round(steps[k]["swap"][0] * 1e3), steps[k]["swap"][1]) for k in range(fs, done + 1)],
                     ntok=[steps[k]["ntok"] for k in range(fs, done + 1)]))
rows.sort(key=lambda r: r["ttft"])
print("n", len(rows), "ttft p50", round(statistics.median(r["ttft"] for r in rows) * 1e3), "ms; wait p50",
      round(statistics.median(r["wait"] for r in rows) * 1e3), "ms; steps waited p50", statistics.median(r["nwait"] for r in rows))
for r in rows[len(rows) // 2 - 4: len(rows) // 2 + 4]:
    print(r["rid"], round(r["ttft"] * 1e3), round(r["wait"] * 1e3), r["nwait"], r["new"], r["step_ms"], r["load"], r["ntok"])
print("steps", len(log), "median ms", round(statistics.median(s["dt"] for s in log) * 1e3, 1),
      "load ms total", round(sum(s["swap"][0] for s in log) * 1e3), "blocks loaded", sum(s["swap"][1] for s in log))
st = eng.stats()
print({k: st[k] for k in st if "disk" in k})
