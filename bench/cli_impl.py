"""What each ``python -m bench`` sub-command does (parsing lives in ``__main__``)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace

from bench import workloads as wl
from bench.corpus import TokenStream
from bench.report import ratio_table, table
from bench.run import rewrite_result, run_and_report
from bench.systems import OPTIONAL, PEERS, PrefixKVSystem, SystemArgs, make_system


def engine_args(args: argparse.Namespace) -> SystemArgs:
    return SystemArgs(model=args.model, dtype=args.dtype, block_size=args.block_size,
                      max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                      kv_tokens=args.kv_tokens, max_admitted_prefill_tokens=args.max_admitted_prefill_tokens)


def load_tokenizer(model: str | None):
    from prefixkv.model.loader import resolve_model
    from prefixkv.tokenizer import Tokenizer

    path = resolve_model(model)
    return path, Tokenizer.from_pretrained(str(path))


def build_workload(name: str, args: argparse.Namespace, tokenizer) -> wl.Workload:
    pb = wl.PromptBuilder(tokenizer, TokenStream.build(tokenizer))
    seed = args.seed
    if name == "shared-prefix":
        w = wl.shared_prefix(pb, args.groups, args.per_group, args.system_tokens, args.question_tokens,
                             args.output_tokens, seed)
    elif name == "multi-turn":
        w = wl.multi_turn(pb, args.conversations, args.turns, args.system_tokens, args.user_tokens,
                          args.output_tokens, args.shared_system)
    elif name == "cold":
        w = wl.cold(pb, args.num_requests, args.min_tokens, args.max_tokens, args.output_tokens, seed)
    elif name == "decode-heavy":
        w = wl.cold(pb, args.num_requests, args.prompt_tokens, args.prompt_tokens, args.output_tokens, seed)
        w.name = "decode-heavy"
    elif name == "parallel-sampling":
        w = wl.parallel_sampling(pb, args.num_requests, args.prompt_tokens, args.output_tokens, args.n, seed=seed)
    else:
        raise ValueError(name)
    w.params["corpus_sha"] = pb.stream.digest
    return w


def fill_sizes(args: argparse.Namespace, workload: str) -> None:
    """ablate takes every workload's size flags without defaults: fill in the chosen one's."""
    from bench.__main__ import SIZES

    for flag, default, _ in SIZES[workload]:
        key = flag.replace("-", "_")
        if getattr(args, key, None) is None:
            setattr(args, key, default)
    if not hasattr(args, "shared_system"):
        args.shared_system = False


def print_summary(doc: dict) -> None:
    print(f"\n{doc['workload']}  {json.dumps(doc['params'], default=str)[:300]}")
    print(table(doc))
    print("\nratios of output tokens/s, median of repeats (row / column):")
    print(ratio_table(doc))
    if doc.get("repeat", 1) > 1:
        print("\nratios of output tokens/s, best of repeats (row / column):")
        print(ratio_table(doc, "ratios_best"))
    ident = doc.get("output_identity", {}).get("systems")
    if ident:
        print(f"\ngreedy outputs identical to {doc['output_identity']['reference']}: "
              + ", ".join(f"{k} {v['identical_fraction']:.0%}" for k, v in ident.items()))
    print(f"\nwrote {doc['json_path']}" + (f" and {doc['png_path']}" if doc.get("png_path") else ""))


def cmd_workload(args: argparse.Namespace, command: str) -> int:
    names = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [n for n in names if n not in PEERS + OPTIONAL and not n.startswith("vllm-b")]
    if bad or not names:
        raise SystemExit(f"bench: error: --systems: unknown {bad} (known: {', '.join(PEERS + OPTIONAL)})")
    path, tok = load_tokenizer(args.model)
    w = build_workload(args.workload, args, tok)
    ea = engine_args(args)
    systems = [make_system(n, ea, path) for n in names]
    doc = run_and_report(w, systems, repeat=args.repeat, out_dir=args.out, command=command, threads=args.threads,
                         engine_args=asdict(ea), plot=not args.no_plot, progress=not args.no_progress,
                         stem=args.stem, max_wait_s=args.wait_quiet)
    print_summary(doc)
    return 0 if all(not r.get("error") for r in doc["systems"].values()) else 1


def cmd_ablate(args: argparse.Namespace, command: str) -> int:
    fill_sizes(args, args.on)
    path, tok = load_tokenizer(args.model)
    w = build_workload(args.on, args, tok)
    base = replace(engine_args(args), enable_prefix_caching=True)
    wanted = {a.strip() for a in args.ablations.split(",") if a.strip()}
    variants: list[tuple[str, SystemArgs]] = [("prefixkv", base)]
    if "policy" in wanted:
        variants.append(("policy=static", replace(base, scheduling_policy="static", max_admitted_prefill_tokens=None)))
    if "cache" in wanted:
        variants.append(("prefix-cache=off", replace(base, enable_prefix_caching=False)))
    if "chunked" in wanted:
        variants.append(("chunked-prefill=off", replace(base, enable_chunked_prefill=False)))
    if "cpu-speed" in wanted:  # each CPU speed change taken away on its own, then all of them
        variants.append(("cpu-linear=onednn", replace(base, cpu_linear="onednn")))
        variants.append(("cpu-linear=torch", replace(base, cpu_linear="torch")))
        variants.append(("attention=torch", replace(base, attention_backend="torch")))
        variants.append(("fused-ops=off", replace(base, fused_cpu_ops=False)))
        variants.append(("all-off", replace(base, cpu_linear="torch", attention_backend="torch", fused_cpu_ops=False)))
    if "block-size" in wanted:
        for bs in (int(x) for x in args.block_sizes.split(",")):
            if bs != base.block_size:
                variants.append((f"block-size={bs}", replace(base, block_size=bs)))
    systems = [PrefixKVSystem(n, a) for n, a in variants]
    doc = run_and_report(w, systems, repeat=args.repeat, out_dir=args.out, command=command, threads=args.threads,
                         engine_args=asdict(base), lazy=True, plot=not args.no_plot, progress=not args.no_progress,
                         stem=args.stem or None, extra=dict(ablation_of=args.on), max_wait_s=args.wait_quiet)
    sweep = []
    for n, a in variants:
        r = doc["systems"][n]
        if n == "prefixkv" or n.startswith("block-size="):
            if r.get("output_tokens_per_s"):
                sweep.append(dict(block_size=a.block_size, output_tokens_per_s=r["output_tokens_per_s"],
                                  kv_util_logical=r["kv_util_logical"], kv_util_physical=r["kv_util_physical"],
                                  internal_fragmentation=r["internal_fragmentation"],
                                  peak_blocks_in_use=r["peak_blocks_in_use"],
                                  peak_kv_slots=(r["peak_blocks_in_use"] or 0) * a.block_size))
    if len(sweep) > 1:
        doc["block_size_sweep"] = sorted(sweep, key=lambda p: p["block_size"])
        jp = rewrite_result(doc)
        if not args.no_plot:
            from bench.report import plot_block_sweep

            plot_block_sweep(sweep, jp.with_name(jp.stem + "-blocks.png"))
    print_summary(doc)
    if sweep:
        print("\nblock size | out tok/s | KV util (logical) | physical | internal frag | peak slots")
        for p in doc.get("block_size_sweep", sweep):
            print(f"{p['block_size']:>10} | {p['output_tokens_per_s']:9.2f} | {p['kv_util_logical']:.3f} "
                  f"| {p['kv_util_physical']:.3f} | {p['internal_fragmentation']:.3f} | {p['peak_kv_slots']}")
    return 0 if all(not r.get("error") for r in doc["systems"].values()) else 1


def dispatch(args: argparse.Namespace, command: str) -> int:
    from bench.__main__ import WORKLOADS

    if args.workload in WORKLOADS:
        return cmd_workload(args, command)
    if args.workload == "ablate":
        return cmd_ablate(args, command)
    from bench import micro

    micro_cmds = {"sched-overhead": micro.cmd_sched_overhead, "memory": micro.cmd_memory, "flops": micro.cmd_flops,
                  "gemm": micro.cmd_gemm, "scale": micro.cmd_scale, "roofline": micro.cmd_roofline}
    if args.workload in micro_cmds:
        return micro_cmds[args.workload](args, command)
    if args.workload == "report":
        from bench import report

        return report.cmd_report(args, command)
    if args.workload == "kernel-ab":
        from bench import kernel_ab

        return kernel_ab.cmd_kernel_ab(args, command)
    if args.workload == "aged-engine":
        from bench import aged_engine

        return aged_engine.cmd_aged_engine(args, command)
    if args.workload == "sliding-window":
        from bench import sliding_window

        return sliding_window.cmd_sliding_window(args, command)
    if args.workload == "ray-routing":
        from bench import ray_routing

        return ray_routing.cmd_ray_routing(args, command)
    if args.workload == "serving":
        from bench import serving

        return serving.cmd_serving(args, command)
    if args.workload == "http":
        from bench import serve_peers

        return serve_peers.cmd_http(args, command)
    if args.workload == "http-ceiling":
        from bench import serve_ceiling

        return serve_ceiling.cmd_ceiling(args, command)
    print(f"bench: unknown command {args.workload}", file=sys.stderr)
    return 2
