"""What the host-memory KV tier buys on multi-turn chat (issue 12), on the embedded SmolLM2 in float32.

Conversations whose total KV is several times the device pool return in random order, one turn
at a time (each turn: a long system prompt of its own, the history with the model's real earlier
replies, a new question; 64 new tokens); with no tier a returning conversation's history has mostly been evicted and is
recomputed, with the host tier it is copied back. Both configurations serve the same turns in the
same order and, being lossless, see the same prompts; they report returning-turn TTFT p50 / p99
(from adding the request to its first token, engine steps driven here), total throughput and
tokens found per tier. Greedy outputs of both are compared (they must be equal).

    python -m bench.tiers [--conversations 12] [--turns 5] [--device-blocks 64] [--host-gb 0.5]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path


TOPICS = ["the sea", "mountains", "bread", "trains", "music", "gardens", "rain", "chess", "bees", "maps", "clocks",
          "rivers", "paper", "glass", "wolves", "salt"]


def _order(conversations: int, turns: int, seed: int) -> list[int]:
    """The conversation of each turn, in serving order: every first turn, then the returning turns
    shuffled."""
    rng = random.Random(seed)
    return list(range(conversations)) + rng.sample([c for c in range(conversations) for _ in range(turns - 1)],
                                                   conversations * (turns - 1))


def _run(llm, order: list[int], max_tokens: int, doc_facts: int) -> dict:
    """Serve the turns one at a time; each conversation's history holds its real replies (so
    both configurations, being lossless, see the same prompts)."""
    from prefixkv import SamplingParams

    eng = llm.engine
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, output_kind="delta")
    # each conversation its own long system prompt (a document it discusses: nothing shared between
    # conversations, so only a tier can keep a returning history)
    history = {c: [{"role": "system", "content": f"You are a patient assistant. The user studies {TOPICS[c % len(TOPICS)]}"
                    f" (notebook {c}). Notes: " + " ".join(f"fact {c}.{j} about {TOPICS[(c + j) % len(TOPICS)]};"
                                                            for j in range(doc_facts))}]
               for c in set(order)}
    returning, outputs, cached, prompt_tokens = [], [], 0, 0
    last_len: dict[int, int] = {}  # each conversation's tokens after its latest turn
    t_all = time.perf_counter()
    for i, c in enumerate(order):
        k = len(history[c]) // 2
        msgs = history[c] + [{"role": "user", "content": f"Turn {k}: tell me something new about "
                                                          f"{TOPICS[c % len(TOPICS)]}, in two paragraphs."}]
        ids = eng.tokenizer.apply_chat_template(msgs)
        prompt_tokens += len(ids)
        t0 = time.perf_counter()
        eng.add_request(f"t{i}", ids, sp)
        first, toks = None, []
        while eng.has_unfinished():
            for out in eng.step():
                if first is None and out.outputs[0].delta_token_ids:
                    first = time.perf_counter() - t0
                toks += out.outputs[0].delta_token_ids
                if out.finished:
                    cached += out.num_cached_tokens
        if k:
            returning.append(first)
        last_len[c] = len(ids) + len(toks)
        outputs.append(toks)
        history[c] = msgs + [{"role": "assistant", "content": eng.tokenizer.decode(toks)}]
    wall = time.perf_counter() - t_all
    stats = eng.stats()
    q = statistics.quantiles(returning, n=100)
    return dict(wall_s=round(wall, 2), out_tok_s=round(len(order) * max_tokens / wall, 1),
                returning_ttft_p50_ms=round(statistics.median(returning) * 1e3, 1),
                returning_ttft_p99_ms=round(q[98] * 1e3, 1), prompt_tokens=prompt_tokens, cached_tokens=cached,
                device_hit_tokens=stats["prefix_hit_tokens"] - stats["prefix_host_hit_tokens"],
                host_hit_tokens=stats["prefix_host_hit_tokens"], host_blocks=stats["num_host_blocks"],
                preemptions=stats["num_preemptions"], conversations_kv_tokens=sum(last_len.values()),
                outputs=outputs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--device-blocks", type=int, default=64, help="the device pool (16-token blocks)")
    p.add_argument("--host-gb", type=float, default=0.5)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--doc-facts", type=int, default=60, help="length of each conversation's system prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "out"))
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    from bench.run import machine_info, write_result
    from prefixkv import LLM

    results = {}
    order = _order(a.conversations, a.turns, a.seed)
    for name, host_gb in (("recompute (no tier)", 0.0), ("host tier", a.host_gb)):
        llm = LLM(model=None, dtype="float32", num_kv_blocks=a.device_blocks, kv_host_cache_gb=host_gb,
                  max_num_batched_tokens=512)
        llm.generate(["warm up"], None)
        results[name] = _run(llm, order, a.max_tokens, a.doc_facts)
        r = {k: v for k, v in results[name].items() if k != "outputs"}
        print(f"{name}: {json.dumps(r)}", flush=True)
    base, tier = results["recompute (no tier)"], results["host tier"]
    identical = base["outputs"] == tier["outputs"]
    summary = dict(returning_ttft_p50_speedup=round(base["returning_ttft_p50_ms"] / tier["returning_ttft_p50_ms"], 2),
                   throughput_ratio=round(tier["out_tok_s"] / base["out_tok_s"], 2), outputs_identical=identical,
                   device_pool_tokens=a.device_blocks * 16, prompt_tokens_served=base["prompt_tokens"],
                   conversations_kv_tokens=base["conversations_kv_tokens"])
    print("summary:", json.dumps(summary))
    for r in results.values():
        r.pop("outputs")
    doc = dict(workload="tiers", command="python -m bench.tiers " + " ".join(argv or []), params=vars(a),
               machine=machine_info(a.threads), results=results, summary=summary, num_turns=len(order))
    path = write_result(doc, a.out, f"tiers-{time.strftime('%Y%m%d-%H%M%S')}")
    print(f"wrote {path}")
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
