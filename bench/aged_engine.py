"""``python -m bench aged-engine``: the same requests offline on a fresh engine and on one that has
served other traffic first, as a server's later rounds run.

Each round builds ``http``'s shared-prefix workload (its prompts, as token ids) and runs it through
``LLM.generate`` twice, taking turns, each in a process of its own started as the engine core is
(bench/offline_run.py): on a fresh engine, and on an engine that first generated that benchmark's
shared-prefix and multi-turn workloads of other text, its prefix cache kept. The aged engine's
requests get the blocks those requests freed and those its cache evicts. With ``--baseline-pool
FILE`` (another version of prefixkv/kv/block_pool.py) a third run ages an engine whose pool is that
file's. Printed: requests/s and the decode-only step's ms of each, and each aged engine's over the
fresh one's, per round and as medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from bench.run import _loadavg, machine_info, write_result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=64, help="max_num_seqs (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=128, help="requests of each workload (default: %(default)s)")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline-pool", default=None, metavar="FILE",
                   help="another block_pool.py: an aged engine with its BlockPool beside this checkout's")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of the engine")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "out"))
    p.add_argument("--stem", default=None)


def _line(figures: dict[str, dict], over: dict[str, float]) -> str:
    """Each engine's req/s and decode step, then each aged one's step over the fresh one's."""
    return ("; ".join(f"{n} {f['request_throughput']:.2f} req/s, decode step {f['decode_step_ms']:.1f} ms"
                      for n, f in figures.items())
            + "; decode step over fresh: " + ", ".join(f"{n} {v:.3f}" for n, v in over.items()))


def cmd_aged_engine(args: argparse.Namespace, command: str) -> int:
    from bench.offline_run import run
    from bench.serve_peers import build_prompts
    from prefixkv.model.loader import resolve_model
    from prefixkv.tokenizer import Tokenizer

    if args.rounds < 1:
        raise SystemExit(f"aged-engine: --rounds must be >= 1, got {args.rounds}")
    if args.baseline_pool and not Path(args.baseline_pool).is_file():
        raise SystemExit(f"aged-engine: --baseline-pool: no file {args.baseline_pool}")
    names = ["fresh", "aged"] + (["aged-baseline"] if args.baseline_pool else [])
    model_dir = resolve_model(args.model)
    tokenizer = Tokenizer.from_pretrained(str(model_dir))
    answers: dict = {}

    def ids(workload: str, seed: int) -> list[list[int]]:
        texts = build_prompts(workload, tokenizer, args.num_prompts, args.output_tokens, seed, model_dir, answers)
        return [tokenizer.encode(t, add_special_tokens=False) for t in texts]

    doc = dict(workload="aged-engine", command=command, params=vars(args), machine=machine_info(args.threads),
               loadavg_start=_loadavg(), rounds=[])
    for r in range(args.rounds):
        seed = args.seed + 1000 * r
        prompts = ids("shared-prefix", seed)
        before = [ids("shared-prefix", seed + 1), ids("multi-turn", seed + 2)]
        answers.pop("llm", None)  # (the multi-turn answers' engine: not beside the timed runs)
        got = {}
        for name in names[r % len(names):] + names[:r % len(names)]:
            res = run({"model": str(model_dir), "prompts": prompts, "output_tokens": args.output_tokens,
                       "max_num_seqs": args.concurrency, "kv_cache_bytes": int(args.kv_cache_gib * (1 << 30)),
                       "threads": args.threads, "before": before if name != "fresh" else [],
                       "block_pool": args.baseline_pool if name == "aged-baseline" else None})
            st = res["engine_steps"]
            got[name] = {"request_throughput": len(prompts) / res["elapsed_s"],
                         "decode_step_ms": 1e3 * st["decode_s"] / max(1, st["num_decode_steps"]),
                         "engine_steps": st}
        over = {n: got[n]["decode_step_ms"] / got["fresh"]["decode_step_ms"] for n in names[1:]}
        print(f"round {r}: {_line(got, over)}", flush=True)
        doc["rounds"].append({"round": r, "seed": seed, "systems": got, "decode_step_over_fresh": over})
    med = {n: {k: statistics.median(x["systems"][n][k] for x in doc["rounds"])
               for k in ("request_throughput", "decode_step_ms")} for n in names}
    over = {n: statistics.median(x["decode_step_over_fresh"][n] for x in doc["rounds"]) for n in names[1:]}
    doc["summary"] = {**med, "decode_step_over_fresh": over}
    doc["loadavg_end"] = _loadavg()
    print(f"medians of {args.rounds}: {_line(med, over)}")
    path = write_result(doc, args.out, args.stem or f"aged-engine-{time.strftime('%Y%m%d-%H%M%S')}")
    print(f"wrote {path}")
    return 0
