"""``python -m bench WORKLOAD [options]`` (also ``prefixkv bench ...``).

Workloads, each run on several systems in the same process (``--systems``)::

    shared-prefix      G groups x P requests sharing an S-token system prompt
    multi-turn         C conversations x T turns, each turn resends the history
    cold               mixed-length prompts, no sharing
    parallel-sampling  n = 4 samples per prompt (temperature 1, seeded)
    decode-heavy       N distinct short prompts, many output tokens each (decode steps dominate)

Within prefixkv only::

    ablate             static vs continuous, prefix cache off/on, chunked prefill off/on, block sizes
    sched-overhead     CPU µs per scheduled request per step (fake model runner)
    memory             requests that fit in a fixed KV budget: paged blocks vs contiguous reservation
    flops              machine matmul GFLOP/s and the fraction the systems reach on decode-heavy work
    gemm               the model's GEMMs through F.linear, oneDNN prepacked, MKL packed and the C GEMM
                       (--c-baseline FILE: another version of the C source beside it), by row count
    scale              host time per engine step at 256-1,024 running, 1e5-1e6 cached blocks (fake runner)
    roofline           a decode step at batch B against the machine's read bandwidth and GEMM peak
    kernel-ab          this checkout's C kernels against another cpu_ops.c, alternating in one process:
                       decode attention alone, or the engine's fused layer stack (--part)
    sliding-window     long chats on a Gemma-3-shaped model in a fixed KV budget: out-of-window blocks freed or kept
    aged-engine        the same requests on a fresh engine and on one that served other traffic first (its blocks)

Against ``prefixkv serve`` (spawned on loopback, or ``--url``)::

    serving            TTFT / TPOT / latency p50-p90-p99 and throughput against the request rate (Poisson)
    http               prefixkv serve vs vLLM's api_server vs llama-server, driven by vllm bench serve
    http-ceiling       served vs offline tokens/s on a tiny model with millisecond steps (the front end's limit)

On Ray Serve (a local Ray instance, replicas of ``prefixkv``)::

    ray-routing        shared prefixes, bursts and a chat template over replicas: Serve's, Ray LLM's and prefixkv's routers

Each run writes one JSON (and a PNG) into ``--out`` (default bench/out/, git-ignored).

    report             the plots of bench/RESULTS.md's summary, made again from bench/results/*.json
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

DEFAULT_OUT = str(Path(__file__).resolve().parent / "out")
ALL_SYSTEMS = "prefixkv,prefixkv-nocache,hf-static,hf-cb"
# vLLM's CPU build (tools/peer-vllm-cpu), prefixkv-spec, prefixkv-invariant, prefixkv-variant, prefixkv-salted:
# opt-in with --systems

# Sizes per workload: (flag, default, help). Defaults finish in a few minutes on 2 cores.
SIZES = {
    "shared-prefix": [("groups", 2, "G: groups with distinct system prompts"),
                      ("per-group", 8, "P: requests per group"),
                      ("system-tokens", 256, "S: system-prompt tokens"),
                      ("question-tokens", 32, "Q: per-request question tokens"),
                      ("output-tokens", 32, "O: output tokens per request (greedy, ignore_eos)")],
    "multi-turn": [("conversations", 8, "C: concurrent conversations"),
                   ("turns", 4, "T: turns per conversation"),
                   ("system-tokens", 128, "system-prompt tokens (distinct per conversation unless --shared-system)"),
                   ("user-tokens", 64, "U: tokens of each new user message (with its role markers)"),
                   ("output-tokens", 32, "O: answer tokens per turn")],
    "cold": [("num-requests", 16, "N: requests"),
             ("min-tokens", 64, "shortest prompt"),
             ("max-tokens", 512, "longest prompt"),
             ("output-tokens", 32, "O: output tokens per request")],
    "parallel-sampling": [("num-requests", 8, "N: prompts"),
                          ("prompt-tokens", 256, "prompt tokens"),
                          ("output-tokens", 32, "O: output tokens per sample"),
                          ("n", 4, "samples per prompt")],
    "decode-heavy": [("num-requests", 16, "N: requests"),
                     ("prompt-tokens", 64, "prompt tokens of each (distinct text)"),
                     ("output-tokens", 256, "O: output tokens per request")],
}
WORKLOADS = tuple(SIZES)


def add_common(p: argparse.ArgumentParser, systems_default: str | None = ALL_SYSTEMS) -> None:
    g = p.add_argument_group("run")
    if systems_default is not None:
        g.add_argument("--systems", default=systems_default,
                       help=f"comma-separated, from {ALL_SYSTEMS},prefixkv-spec,prefixkv-invariant,prefixkv-variant,prefixkv-salted,vllm-b16,vllm-b32 "
                            "(default: %(default)s)")
    g.add_argument("--out", default=DEFAULT_OUT, help="directory for the JSON and PNG (default: bench/out/)")
    g.add_argument("--repeat", type=int, default=1, help="repeats per system, interleaved; median reported")
    g.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default: %(default)s)")
    g.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                   help="before each turn wait up to S seconds for the canary matmul to reach 60%% of the "
                        "best seen (other processes on the cores)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-plot", action="store_true")
    g.add_argument("--no-progress", action="store_true")
    g.add_argument("--stem", default=None, help="file name stem of the JSON/PNG (default: workload-time)")
    from prefixkv.engine_args import admitted_prefill_tokens

    e = p.add_argument_group("engine (mirrored by the peers where they have the knob)")
    e.add_argument("--model", default=None, help="local HF model dir or .gguf (default: embedded SmolLM2-135M-Instruct)")
    e.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"])
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--max-num-seqs", type=int, default=64, help="engine max batch; hf-static batch size")
    e.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget per step")
    e.add_argument("--max-admitted-prefill-tokens", type=admitted_prefill_tokens, default="auto",
                   help="prefixkv: prompt tokens of new requests after which a step admits no short prefill: "
                        "auto (the engine's default), none or an int (no peer has the knob)")
    e.add_argument("--kv-tokens", type=int, default=32768, help="KV budget in tokens (engine and hf-cb)")


def add_sizes(p: argparse.ArgumentParser, workload: str, use_defaults: bool = True) -> None:
    g = p.add_argument_group(f"{workload} sizes")
    for flag, default, help_ in SIZES[workload]:
        try:
            g.add_argument(f"--{flag}", type=int, default=default if use_defaults else None,
                           help=f"{help_} (default: {default})")
        except argparse.ArgumentError:
            pass  # the same flag in two workloads (ablate takes them all)
    if workload == "multi-turn":
        try:
            g.add_argument("--shared-system", action="store_true",
                           help="one system prompt for all conversations")
        except argparse.ArgumentError:
            pass


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="workload", required=True)
    for w in WORKLOADS:
        p = sub.add_parser(w, help=f"{w} workload")
        add_sizes(p, w)
        add_common(p)
    p = sub.add_parser("ablate", help="prefixkv variants on one workload, same run")
    p.add_argument("--on", default="shared-prefix", choices=WORKLOADS, help="workload (default: %(default)s)")
    p.add_argument("--ablations", default="policy,cache,chunked,block-size",
                   help="comma-separated from policy,cache,chunked,block-size,cpu-speed")
    p.add_argument("--block-sizes", default="1,8,16,32,64,128")
    for w in WORKLOADS:
        add_sizes(p, w, use_defaults=False)
    add_common(p, systems_default=None)
    p = sub.add_parser("sched-overhead", help="scheduler CPU cost per scheduled request per step")
    p.add_argument("--sizes", default="32,128,256", help="running requests")
    p.add_argument("--steps", type=int, default=200, help="timed decode steps per size")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--engine", action="store_true",
                   help="also time a whole LLMEngine.step with the model replaced by a fake (loads the model)")
    add_common(p, systems_default=None)
    p = sub.add_parser("memory", help="paged blocks vs contiguous reservation in a fixed KV budget")
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--budget-tokens", type=int, default=32768)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=512)
    add_common(p, systems_default=None)
    p = sub.add_parser("flops", help="matmul GFLOP/s and the fraction reached on decode-heavy work")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=64)
    add_common(p, systems_default="prefixkv,hf-static")
    p = sub.add_parser("gemm", help="the model's GEMMs: F.linear vs oneDNN prepacked vs MKL packed")
    p.add_argument("--rows", default="1,16,32,512")
    p.add_argument("--repeat-passes", type=int, default=7)
    p.add_argument("--c-baseline", default=None, metavar="FILE",
                   help="another cpu_ops.c to run beside the current C GEMM (same flags; bits compared)")
    add_common(p, systems_default=None)
    p = sub.add_parser("scale", help="host time per engine step at GPU scale (fake runner, no model)")
    p.add_argument("--sizes", default="256,1024", help="running requests")
    p.add_argument("--cached-blocks", default="1e5,1e6", help="cached (evictable) blocks beside them")
    p.add_argument("--context-tokens", type=int, default=32768)
    p.add_argument("--steps", type=int, default=20)
    add_common(p, systems_default=None)
    p = sub.add_parser("roofline", help="a decode step at batch B against read bandwidth and GEMM peak")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--system-tokens", type=int, default=196)
    p.add_argument("--question-tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=40, help="timed decode steps per round")
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds of (read bandwidth, GEMM peak, decode steps): each round's ratio uses the "
                        "figures measured beside its own steps; the median round is reported")
    add_common(p, systems_default=None)
    p = sub.add_parser("kernel-ab", help="the C kernels against another cpu_ops.c: attention alone or the layer stack")
    from bench.kernel_ab import add_arguments as add_kernel_ab

    add_kernel_ab(p)
    add_common(p, systems_default=None)
    p = sub.add_parser("aged-engine", help="the same requests offline on a fresh engine and on one that served "
                                           "other traffic first")
    from bench.aged_engine import add_arguments as add_aged_engine

    add_aged_engine(p)
    p = sub.add_parser("serving", help="prefixkv serve: latency percentiles and throughput against request rate")
    from bench.serving import add_arguments

    add_arguments(p)
    p = sub.add_parser("http", help="prefixkv serve vs vLLM's api_server vs llama-server through HTTP, driven by "
                                    "vllm bench serve (shared-prefix, multi-turn, cold; two concurrencies)")
    from bench.serve_peers import add_arguments as add_http

    add_http(p)
    p = sub.add_parser("http-ceiling", help="served vs offline tokens/s of one engine on a tiny model with "
                                            "millisecond steps, N concurrent streams")
    from bench.serve_ceiling import add_arguments as add_ceiling

    add_ceiling(p)
    p = sub.add_parser("sliding-window", help="Gemma-3-shaped long chats in a fixed KV budget: out-of-window "
                                              "blocks freed (KV cache groups) vs kept")
    from bench.sliding_window import add_arguments as add_sliding_window

    add_sliding_window(p)
    p = sub.add_parser("ray-routing", help="Ray Serve replicas: power-of-two, prefix-affinity, "
                                            "cache-threshold and cache-aware routing")
    from bench.ray_routing import add_arguments as add_ray_routing

    add_ray_routing(p)
    p = sub.add_parser("report", help="the plots of bench/RESULTS.md's summary, from the JSON in bench/results/")
    from bench.report import RESULTS_DIR

    p.add_argument("--results", default=str(RESULTS_DIR), help="where the JSON is (default: bench/results/)")
    p.add_argument("--out", default=None, help="where the PNGs go (default: RESULTS/summary/)")
    p.set_defaults(threads=1)
    return parser


def command_line(argv: list[str]) -> str:
    return "python -m bench " + " ".join(shlex.quote(a) for a in argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from bench import cli_impl

    return cli_impl.dispatch(args, command_line(argv))


if __name__ == "__main__":
    sys.exit(main())
