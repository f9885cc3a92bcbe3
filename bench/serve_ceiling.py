"""``python -m bench http-ceiling``: how many tokens per second the serving path carries when the
engine's steps take milliseconds -- the front end's own limit, as on a GPU.

The model is a tiny random Llama (2 layers, hidden 128, head_dim 64) with the embedded SmolLM2's
real tokenizer and vocabulary (49,152 tokens: detokenization costs what it costs with the real
model), saved once under ``--out``. ``--streams`` requests of ``--prompt-tokens`` distinct tokens each generate
``--output-tokens`` tokens (greedy, ``ignore_eos``):

- offline: ``LLM.generate`` (``bench/offline_run.py``, a fresh interpreter), ``max_num_seqs`` =
  streams: output tokens/s, and the CPU seconds its process took a token (every thread: what the
  served engine core's CPU a token compares with);
- served: each system of ``--systems`` started (prefixkv serve: the engine in its own process;
  prefixkv-inproc: in a thread of the HTTP process; vllm: vLLM's api_server), driven by ``vllm bench
  serve`` at concurrency = streams: output tokens/s, and served / the same round's offline;
  ``--stream-interval N`` starts prefixkv and vLLM with their ``--stream-interval N`` (a chunk every
  N tokens instead of every token);
- where the CPU went while the load ran: CPU seconds of the server's own process (the front end),
  of the processes it started (the engine core; vLLM's engine core and worker), and of the load
  generator (after its imports).

The load generator runs on the same CPUs as the server; ``--rounds`` alternate the systems.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench.serve_peers import (ROOT, add_load_generator_nice, check_load_generator_nice, check_stream_interval,
                               run_load, start_server)

PROG = "bench http-ceiling"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--systems", default="prefixkv,prefixkv-inproc", help="from prefixkv, prefixkv-inproc, vllm")
    p.add_argument("--streams", default="64,256", help="comma-separated concurrent streams (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--stream-interval", type=int, default=1,
                   help="the servers' --stream-interval (prefixkv and vLLM): a chunk every this many tokens")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of the offline run")
    p.add_argument("--out", default=str(ROOT / "bench" / "out"))
    p.add_argument("--stem", default=None)
    p.add_argument("--startup-seconds", type=float, default=900.0)
    p.add_argument("--seed", type=int, default=0)
    add_load_generator_nice(p)


def tiny_model(out: Path) -> Path:
    """A 2-layer, 128-wide random Llama with SmolLM2's tokenizer (built once, kept under ``out``: the
    cache directory, never the results);
    head_dim 64: vLLM's CPU attention takes no head_dim 16 ("Unsupported CPU attention configuration")."""
    path = out / "ceiling-tiny-smollm2-vocab-d64"
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from prefixkv.model.loader import resolve_model

    src = resolve_model(None)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".ceiling-", dir=out))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, torch_dtype="float32")
    LlamaForCausalLM(cfg).save_pretrained(tmp)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / f).is_file():
            shutil.copy(src / f, tmp / f)
    tmp.rename(path)
    return path


def offline_tokens(model_dir: Path, prompts: list[list[int]], output_tokens: int, threads: int) -> tuple[float, float]:
    """The offline run's output tokens/s and its process's CPU seconds (every thread) a token."""
    from bench.offline_run import run

    res = run({"model": str(model_dir), "prompts": prompts, "output_tokens": output_tokens,
               "max_num_seqs": len(prompts), "kv_cache_bytes": 1 << 30, "threads": threads})
    return res["num_output_tokens"] / res["elapsed_s"], res["cpu_s"] / res["num_output_tokens"]


def cmd_ceiling(args: argparse.Namespace, command: str) -> int:
    import torch

    from bench.run import _loadavg, machine_info
    from prefixkv.tokenizer import Tokenizer

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    streams = [int(s) for s in args.streams.split(",") if s.strip()]
    check_stream_interval(args.stream_interval, systems)
    check_load_generator_nice(args.load_generator_nice)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from prefixkv.cache_dir import cache_root

    model_dir = tiny_model(cache_root())
    tokenizer = Tokenizer.from_pretrained(str(model_dir))
    workdir = Path(tempfile.mkdtemp(prefix="bench-ceiling-"))
    doc = {"command": command, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
           "machine": machine_info(torch.get_num_threads()), "model": str(model_dir), "systems": systems,
           "streams": streams, "stream_interval": args.stream_interval, "prompt_tokens": args.prompt_tokens,
           "output_tokens": args.output_tokens, "load_generator_nice": args.load_generator_nice, "runs": [],
           "loadavg_start": _loadavg()}
    try:
        for n in streams:
            server_args = argparse.Namespace(max_num_seqs=n, kv_cache_gib=1.0, output_tokens=args.output_tokens,
                                             seed=args.seed, stream_interval=args.stream_interval,
                                             max_wait_steps=None, load_generator_nice=args.load_generator_nice)
            servers = {name: start_server(name, model_dir, "tiny", server_args, n) for name in systems}
            for srv in servers.values():
                srv.wait_ready(args.startup_seconds)
            try:
                for r in range(args.rounds):
                    base = 1000 + 7919 * (r + 1)
                    ids = [[(base + 31 * i + k) % 40000 + 100 for k in range(args.prompt_tokens)] for i in range(n)]
                    texts = [tokenizer.decode(p, skip_special_tokens=False) for p in ids]
                    run = {"streams": n, "round": r, "systems": {}, "loadavg": _loadavg()}
                    order = systems[r % len(systems):] + systems[:r % len(systems)]
                    for name in order:
                        res = run_load(servers[name], texts, server_args, n, model_dir, "tiny", workdir,
                                       f"ceiling-{n}-{r}")
                        run["systems"][name] = {k: res.get(k) for k in ("output_throughput", "request_throughput",
                                                                         "median_itl_ms", "median_ttft_ms", "failed",
                                                                         "server_cpu_s", "load_generator_cpu_s",
                                                                         "load_generator_run_cpu_s", "completed",
                                                                         "total_output_tokens")}
                        cpu = res["server_cpu_s"]
                        print(f"streams {n} round {r} {name}: {res['output_throughput']:.0f} tok/s; CPU s: front "
                              f"{cpu['front']:.2f}, engine {cpu['engine']:.2f}, load generator "
                              f"{res.get('load_generator_cpu_s', float('nan')):.2f} (in its requests "
                              f"{res.get('load_generator_run_cpu_s') or float('nan'):.2f})", flush=True)
                    # the offline run encodes the served text again: the same token counts as served
                    enc = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
                    run["offline_tokens_per_s"], run["offline_cpu_s_per_token"] = offline_tokens(
                        model_dir, enc, args.output_tokens, args.threads)
                    print(f"streams {n} round {r} offline: {run['offline_tokens_per_s']:.0f} tok/s, "
                          f"{run['offline_cpu_s_per_token'] * 1e6:.0f} CPU µs a token", flush=True)
                    doc["runs"].append(run)
            finally:
                for name, srv in servers.items():
                    doc.setdefault("exit_codes", {})[f"{name}-{n}"] = srv.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    doc["loadavg_end"] = _loadavg()
    doc["summary"] = []
    med = statistics.median
    for n in streams:
        runs = [r for r in doc["runs"] if r["streams"] == n]
        offline = med(r["offline_tokens_per_s"] for r in runs)
        for name in systems:
            got = [r["systems"][name] for r in runs]
            served = med(g["output_throughput"] for g in got)
            ratio = med(g["output_throughput"] / r["offline_tokens_per_s"] for g, r in zip(got, runs))
            cpu = {k: med(g["server_cpu_s"][k] for g in got) for k in ("front", "engine")}
            cpu["load_generator"] = med(g.get("load_generator_cpu_s") or float("nan") for g in got)
            cpu["load_generator_run"] = med(g.get("load_generator_run_cpu_s") or float("nan") for g in got)
            doc["summary"].append({"streams": n, "system": name, "served": served, "offline": offline,
                                   "ratio": ratio, "cpu_s": cpu})
    print_summary(doc)
    path = out / f"{args.stem or 'http-ceiling-' + time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {path}")
    return 0


def print_summary(doc: dict) -> None:
    """The run's table from its JSON: each round's served over that round's offline (the offline
    runs move with the machine too), the median of those."""
    print(f"\n{doc['command']}\nload average {doc['loadavg_start']} -> {doc.get('loadavg_end')}")
    print("| streams | system | served tok/s | offline tok/s | served / offline (median of the rounds') | "
          "CPU s: front / engine / load generator (in its requests, where recorded) |\n|---|---|---|---|---|---|")
    for row in doc["summary"]:
        cpu = {"front": float("nan"), "engine": float("nan"), "load_generator": float("nan"),
               "load_generator_run": float("nan"),
               **(row.get("cpu_s") or {})}  # older runs lack some (none before `a5a7bd7`)
        print(f"| {row['streams']} | {row['system']} | {row['served']:.0f} | {row['offline']:.0f} | {row['ratio']:.2f} | "
              f"{cpu['front']:.2f} / {cpu['engine']:.2f} / {cpu['load_generator']:.2f}"
              f"{'' if math.isnan(cpu['load_generator_run']) else ' (%.2f)' % cpu['load_generator_run']} |")
