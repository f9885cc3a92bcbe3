"""What retention buys a shared system prompt while other tenants churn the KV pool (issue 45).

Each round: ``--tenants`` requests of other tenants (each its own ``cache_salt``, a distinct prompt
of ``--tenant-tokens`` tokens), ``--max-num-seqs`` at a time, fill the device pool several times over; then one
request with the shared ``--system-tokens``-token system prompt and a question of its own. Two
engines serve the same rounds, alternating round by round (paired under the same machine noise):
one without retention, one whose shared requests carry ``kv_retention_ttl_s``. Reported: the
shared requests' prefix-cache hit rate and TTFT (from adding the request to its first token,
engine steps driven here) p50, from the second round on (the first is cold in both); greedy first
tokens compared (they must be equal: retention changes what is cached, never what is computed).

    python -m bench.retention [--tenants 50] [--rounds 6] [--device-blocks 64] [--model DIR]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path


def _serve(eng, request_id: str, ids: list[int], sp) -> tuple[float, int, list[int]]:
    """(seconds to its first token, cached tokens, tokens) of one request served alone."""
    t0 = time.perf_counter()
    eng.add_request(request_id, ids, sp)
    first, toks = None, []
    while True:
        for out in eng.step():
            if first is None and out.outputs[0].delta_token_ids:
                first = time.perf_counter() - t0
            toks += out.outputs[0].delta_token_ids
            if out.finished:
                return first, out.num_cached_tokens, toks


def _churn(eng, ids: list[list[int]], sps: list) -> None:
    for i, (p, sp) in enumerate(zip(ids, sps)):
        eng.add_request(f"c{time.perf_counter_ns()}-{i}", p, sp)
    while eng.has_unfinished():
        eng.step()


def main(argv: list[str] | None = None) -> int:
    import sys

    argv = sys.argv[1:] if argv is None else argv  # (recorded in the JSON's command)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a local model directory (default: the embedded SmolLM2)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tenants", type=int, default=50)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=256)
    p.add_argument("--question-tokens", type=int, default=16)
    p.add_argument("--tenant-tokens", type=int, default=64)
    p.add_argument("--device-blocks", type=int, default=64, help="the device pool, in --block-size blocks")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=8,
                   help="requests running at once: their pages and the retained ones fit the pool together (past "
                        "that, retained pages are evicted for the running ones: retention never holds a request back)")
    p.add_argument("--ttl", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "out"))
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    from bench.run import machine_info, write_result
    from prefixkv import LLM, SamplingParams

    engines = {name: LLM(model=a.model, dtype=a.dtype, num_kv_blocks=a.device_blocks, block_size=a.block_size,
                         max_num_seqs=a.max_num_seqs).engine for name in ("no retention", "retention")}
    vocab = engines["retention"].info.vocab_size
    rng = random.Random(a.seed)
    draw = lambda n: [rng.randrange(100, vocab - 100) for _ in range(n)]  # noqa: E731
    system = draw(a.system_tokens)
    rounds = [dict(question=draw(a.question_tokens), churn=[draw(a.tenant_tokens) for _ in range(a.tenants)])
              for _ in range(a.rounds)]
    churn_sps = [SamplingParams(max_tokens=1, temperature=0.0, cache_salt=f"tenant-{t}", output_kind="delta")
                 for t in range(a.tenants)]
    shared = {"no retention": SamplingParams(max_tokens=1, temperature=0.0, output_kind="delta"),
              "retention": SamplingParams(max_tokens=1, temperature=0.0, output_kind="delta",
                                          kv_retention_ttl_s=a.ttl)}
    rows: dict[str, list[dict]] = {name: [] for name in engines}
    for r, rd in enumerate(rounds):
        for name in (engines if r % 2 == 0 else reversed(list(engines))):  # alternate which goes first
            eng = engines[name]
            ids = system + rd["question"]
            ttft, cached, toks = _serve(eng, f"shared-{r}", ids, shared[name])
            rows[name].append(dict(round=r, ttft_s=ttft, cached_tokens=cached, prompt_tokens=len(ids), tokens=toks))
            _churn(eng, rd["churn"], churn_sps)
    assert [x["tokens"] for x in rows["retention"]] == [x["tokens"] for x in rows["no retention"]], \
        "greedy tokens differ with retention"
    summary = {}
    for name, rs in rows.items():
        warm = rs[1:]
        stats = engines[name].stats()
        summary[name] = dict(
            hit_rate=round(sum(x["cached_tokens"] for x in warm) / sum(x["prompt_tokens"] for x in warm), 3),
            ttft_p50_ms=round(statistics.median(x["ttft_s"] for x in warm) * 1e3, 1),
            ttft_ms=[round(x["ttft_s"] * 1e3, 1) for x in rs],
            retained_blocks_evicted=stats["retained_blocks_evicted"], retention_lapsed=stats["retention_lapsed"])
    ratio = summary["no retention"]["ttft_p50_ms"] / summary["retention"]["ttft_p50_ms"]
    for name, s in summary.items():
        print(f"{name:>13}: shared prompt hit rate {s['hit_rate']:.3f}, TTFT p50 {s['ttft_p50_ms']} ms "
              f"(per round {s['ttft_ms']})")
    print(f"TTFT p50 without / with retention: {ratio:.2f}x")
    doc = dict(bench="retention", command="python -m bench.retention " + " ".join(argv), args=vars(a),
               machine=machine_info(a.threads), summary=summary, ttft_ratio=round(ratio, 2))
    path = write_result(doc, a.out, f"retention-{int(time.time())}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
