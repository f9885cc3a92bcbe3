"""``python -m bench kernel-ab --baseline OTHER.c``: this checkout's C kernels against another version of
prefixkv/csrc/cpu_ops.c (``git show REV:prefixkv/csrc/cpu_ops.c > /tmp/old.c``), built with the same
flags and run in one process, the two taking turns pass by pass, so both see the same machine minute.

``--part attention`` (default): the paged decode attention kernel alone, as a decode step calls it
layer after layer. ``--rows`` sequences, each its ``--shared-tokens`` prefix (the same blocks for all)
plus its own tokens up to ``--context``; ``--prefill-rows Q`` gives each sequence Q consecutive rows
(positions context-Q+1 .. context): a prefill chunk as the batch-invariant mode computes it. Every
layer has its own part of one huge-page cache and ``--flush-mb`` MB are read between layers, as the
weights stream through the caches between a step's layers (``--hot``: every layer reads the same
part, which then stays in cache). The outputs of the two builds are compared bit for bit.

``--part layers``: the engine's fused layer stack (model/fused_stack.py) in decode steps at
``--batch`` (each sequence ``--system-tokens`` shared + ``--question-tokens`` own tokens, after
``--warm`` steps), the call made with the current and the baseline library on alternate steps.
The baseline must define the same ``decoder_layer_f32`` / ``decoder_step_f32`` structs (an older one
may lack ``decoder_step_f32``'s last field, ``row_order``: it then takes the rows in turn).

Medians of the timed passes; one JSON into ``--out``."""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from pathlib import Path

from bench.run import _loadavg, machine_info, write_result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--baseline", required=True, metavar="FILE", help="another cpu_ops.c (same entry points)")
    p.add_argument("--part", choices=("attention", "layers"), default="attention")
    p.add_argument("--passes", type=int, default=20, help="timed passes of each build (default: %(default)s)")
    a = p.add_argument_group("--part attention")
    a.add_argument("--rows", type=int, default=16, help="sequences (default: %(default)s)")
    a.add_argument("--shared-tokens", type=int, default=196, help="prefix tokens every sequence shares")
    a.add_argument("--context", type=int, default=412, help="each sequence's tokens, the prefix included")
    a.add_argument("--prefill-rows", type=int, default=1, help="Q consecutive rows a sequence (1: decode)")
    a.add_argument("--num-layers", type=int, default=30)
    a.add_argument("--heads", type=int, default=9)
    a.add_argument("--kv-heads", type=int, default=3)
    a.add_argument("--head-dim", type=int, default=64, choices=(64, 128))
    a.add_argument("--flush-mb", type=int, default=18, help="MB read between layers (0: none)")
    a.add_argument("--hot", action="store_true", help="every layer reads the same KV (kept in cache)")
    s = p.add_argument_group("--part layers")
    s.add_argument("--batch", type=int, default=16)
    s.add_argument("--system-tokens", type=int, default=196)
    s.add_argument("--question-tokens", type=int, default=32)
    s.add_argument("--warm", type=int, default=0, help="decode steps before the timed ones (longer contexts)")


def _alternate(passes: int, run: dict) -> dict[str, float]:
    """Median ms of each of ``run``'s callables (each returns the seconds it timed) over ``passes``
    turns each, one untimed turn first."""
    times: dict[str, list[float]] = {k: [] for k in run}
    for i in range(passes + 1):
        for name, fn in run.items():
            t = fn()
            if i:
                times[name].append(t)
    return {k: round(statistics.median(v) * 1e3, 3) for k, v in times.items()}


def attention(args: argparse.Namespace, libs: dict) -> dict:
    import torch

    from prefixkv import cpu_ops, hugepages

    layers, rows, q_rows = args.num_layers, args.rows, args.prefill_rows
    h, kvh, d, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    if not 0 <= args.shared_tokens <= args.context or q_rows < 1 or q_rows > args.context:
        raise SystemExit("kernel-ab: need 0 <= --shared-tokens <= --context and 1 <= --prefill-rows <= --context")
    g = torch.Generator().manual_seed(args.seed)
    per_seq = -(-args.context // bs)
    shared = args.shared_tokens // bs
    num_blocks = shared + rows * (per_seq - shared) + 1
    # [layers, 2, blocks, kv_heads, block_size, head_dim]: one allocation, each layer its own part
    cache = hugepages.empty((layers, 2, num_blocks, kvh, bs, d), dtype=torch.float32)
    cache.copy_(torch.randn(cache.shape, generator=g))
    per_layer = [cache[0]] * layers if args.hot else [cache[i] for i in range(layers)]
    perm = torch.randperm(num_blocks - 1, generator=g).to(torch.int32)
    own = per_seq - shared
    tables = [torch.cat([perm[:shared], perm[shared + b * own: shared + (b + 1) * own]]) for b in range(rows)]
    table = torch.stack([t for t in tables for _ in range(q_rows)]).contiguous()  # [rows * Q, per_seq]
    lens = torch.tensor([args.context - q_rows + 1 + i for _ in tables for i in range(q_rows)], dtype=torch.int32)
    n = rows * q_rows
    q = torch.randn((n, h, d), generator=g)  # [n, heads, head_dim]
    flush = torch.ones(args.flush_mb << 18)  # float32: MB * 2^18 values
    outs = {name: torch.empty((n, h, d)) for name in libs}

    def one_pass(name: str):
        fn = libs[name].paged_decode_attention_f32
        out = outs[name]
        order = (None,) if cpu_ops.takes_order(libs[name]) else ()  # the rows in turn (a null order)

        def run() -> float:  # the kernel calls' time, not the reads between them
            spent = 0.0
            for kv in per_layer:
                if args.flush_mb:
                    flush.sum()
                t0 = time.perf_counter()
                fn(q.data_ptr(), q.stride(0), kv.data_ptr(), table.data_ptr(), lens.data_ptr(), *order,
                   out.data_ptr(), n, h, kvh, d, bs, table.shape[1], num_blocks, ctypes.c_float(d ** -0.5), 0,
                   ctypes.c_float(0.0))
                spent += time.perf_counter() - t0
            return spent
        return run

    ms = _alternate(args.passes, {name: one_pass(name) for name in libs})
    return dict(ms_per_pass=ms, rows=n, bitwise_equal=torch.equal(outs["current"], outs["baseline"]))


def layers(args: argparse.Namespace, libs: dict) -> dict:
    from bench.profile_step import shared_prefix_decodes
    from prefixkv import LLM
    from prefixkv.model import fused_stack

    llm = LLM(model=args.model, dtype="float32", block_size=args.block_size, max_num_seqs=max(64, args.batch),
              num_kv_blocks=max(64, args.batch * -(-(args.system_tokens + args.question_tokens + args.warm
                                                     + 4 * args.passes) // args.block_size) + 8))
    eng = llm.engine
    why = fused_stack.blocker(eng.runner.model)
    if why is not None:
        raise SystemExit(f"kernel-ab --part layers: the fused layer stack does not run here ({why})")
    fns = {name: lib.decoder_layers_f32 for name, lib in libs.items()}
    times: dict[str, list[float]] = {name: [] for name in libs}
    turn = ["current"]
    call = fused_stack.FusedStack.__call__

    def timed(self, *a, **kw):
        self.fn = fns[turn[0]]
        t0 = time.perf_counter()
        try:
            return call(self, *a, **kw)
        finally:
            times[turn[0]].append(time.perf_counter() - t0)

    shared_prefix_decodes(eng, args.batch, args.system_tokens, args.question_tokens)
    for _ in range(args.warm):
        eng.step()
    fused_stack.FusedStack.__call__ = timed
    try:
        for i in range(2 * args.passes + 2):
            turn[0] = "current" if i % 2 == 0 else "baseline"
            eng.step()
    finally:
        fused_stack.FusedStack.__call__ = call
    ms = {k: round(statistics.median(v[1:]) * 1e3, 3) for k, v in times.items()}
    return dict(ms_per_pass=ms, calls={k: len(v) for k, v in times.items()}, batch=args.batch)


def cmd_kernel_ab(args: argparse.Namespace, command: str) -> int:
    from prefixkv import cpu_ops

    current = cpu_ops.load()
    if current is None or current.vector_bits == 0:
        raise SystemExit("kernel-ab: no AVX-512 / AVX2 build of the C kernels on this machine")
    libs = {"current": current, "baseline": cpu_ops.load_source(Path(args.baseline))}
    load0 = _loadavg()
    res = attention(args, libs) if args.part == "attention" else layers(args, libs)
    ms = res["ms_per_pass"]
    res["baseline_over_current"] = round(ms["baseline"] / ms["current"], 3)
    print(f"{args.part}: current {ms['current']} ms, baseline ({args.baseline}) {ms['baseline']} ms, "
          f"baseline / current {res['baseline_over_current']}"
          + (f", bitwise equal {res['bitwise_equal']}" if "bitwise_equal" in res else ""), flush=True)
    doc = dict(workload="kernel-ab", part=args.part, command=command, baseline=args.baseline,
               params=vars(args),
               machine=machine_info(args.threads), loadavg_start=load0, loadavg_end=_loadavg(), **res)
    path = write_result(doc, args.out, args.stem or f"kernel-ab-{args.part}-{time.strftime('%Y%m%d-%H%M%S')}")
    print(f"wrote {path}")
    return 0
