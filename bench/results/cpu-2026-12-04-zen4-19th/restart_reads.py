"""(nineteenth session) WAIT=0|0.1 PYTHONPATH=. .venv/bin/python bench/results/cpu-2026-12-04-zen4-19th/restart_reads.py
restart_split.py with the disk reader thread's reads timed: per read, bursts (reads < 20 ms apart), the first
burst and first steps, every TTFT, the bounded wait's counters."""
import runpy, sys, time, statistics, threading
from prefixkv.runner import disk_store
R = []
orig = disk_store.DiskKVStore._read_op
def timed(self, key):
    t0 = time.perf_counter(); orig(self, key); R.append((t0, time.perf_counter() - t0))
disk_store.DiskKVStore._read_op = timed
g = runpy.run_path("bench/results/cpu-2026-12-04-zen4-18th/restart_split.py", run_name="__main__")
d = [x[1] for x in R]
print("reads", len(d), "per read ms p50", round(statistics.median(d)*1e3, 2), "p90", round(sorted(d)[int(.9*len(d))]*1e3, 2), "total s", round(sum(d), 2))
# reads grouped into bursts separated by >50ms gaps
R.sort(); bursts=[]; cur=[R[0]]
for r in R[1:]:
    if r[0] - (cur[-1][0]+cur[-1][1]) > 0.02: bursts.append(cur); cur=[r]
    else: cur.append(r)
bursts.append(cur)
print("bursts", [(len(b), round((b[-1][0]+b[-1][1]-b[0][0])*1e3)) for b in bursts[:30]])
st = g["eng"].stats(); print("waited s", st["disk_wait_s"], "won", st["disk_wait_admissions"], "put off", st["disk_admission_waits"])
t00 = min(a[0] for a in g["adds"].values())
print("first burst reads (start ms, dur ms):", [(round((a-t00)*1e3), round(b*1e3,1)) for a, b in R[:438:25]])
print("first steps (start ms, dur ms, ntok, load):", [(round((s["t0"]-t00)*1e3), round(s["dt"]*1e3), s["ntok"], s["swap"][1]) for s in g["log"][:25]])
rows = sorted(g["rows"], key=lambda r: r["ttft"]); print("ttfts", [round(r["ttft"]*1e3) for r in rows])
print("first steps swap (ms, load, swap_in):", [(round(s["swap"][0]*1e3), s["swap"][1], s["swap"][2], round(s["dt"]*1e3), s["ntok"]) for s in g["log"] if s["ntok"] > 8][:12])
