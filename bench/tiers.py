"""What the host-memory KV tier buys on multi-turn chat (issue 12), on the embedded SmolLM2 in float32.

Conversations whose total KV is several times the device pool return in random order, one turn
at a time or ``--concurrency`` turns of different conversations at once (each turn: a long system
prompt of its own, the history with the model's real earlier replies, a new question; 64 new
tokens); with no tier a returning conversation's history has mostly been evicted and is
recomputed, with the host tier it is copied back. Both configurations serve the same turns in the
same order and, being lossless, see the same prompts; they report returning-turn TTFT p50 / p99
(from adding the request to its first token, engine steps driven here), total throughput and
tokens found per tier. Greedy outputs of both are compared (they must be equal).

    python -m bench.tiers [--conversations 12] [--turns 5] [--device-blocks 64] [--host-gb 0.5]

Then the same with the disk tier under a small host tier, and a restart: every turn but each
conversation's last is served, the engine shuts down cleanly, a new one on the same directory
serves the last turns (their TTFT against a fresh engine without tiers).

Peers on the same turns: transformers ``generate`` (one turn at a time, no cache across turns;
``--no-hf`` skips it) and, with ``--vllm``, vLLM's CPU build (``tools/peer-vllm-cpu``) given the
recompute run's token ids in the same order and concurrency, its KV pool as large as the device
pool (vLLM's CPU build has no host tier); the restart's last turns on a new vLLM process.

``--gemma3-shape``: the same turns on a Gemma-3-shaped model (``bench/sliding_window.py``'s: every
sixth layer global, the others a sliding window of ``--window`` tokens; random weights, float32)
with the host tier and with the disk tier under a small host tier, each with the windows' blocks
freed (KV cache groups, the default) and with every block kept (``disable_hybrid_kv_cache_manager``),
in the same device, host and disk memory, and without a tier: returning turns' TTFT of each.

    python -m bench.tiers --gemma3-shape [--window 256] [--layers 12] [--hidden 256]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
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


def _histories(conversations: int, doc_facts: int) -> dict[int, list[dict]]:
    # each conversation its own long system prompt (a document it discusses: nothing shared between
    # conversations, so only a tier can keep a returning history)
    return {c: [{"role": "system", "content": f"You are a patient assistant. The user studies {TOPICS[c % len(TOPICS)]}"
                 f" (notebook {c}). Notes: " + " ".join(f"fact {c}.{j} about {TOPICS[(c + j) % len(TOPICS)]};"
                                                         for j in range(doc_facts))}]
            for c in range(conversations)}


def _prompt(history: dict[int, list[dict]], c: int) -> list[dict]:
    k = len(history[c]) // 2
    return history[c] + [{"role": "user", "content": f"Turn {k}: tell me something new about "
                                                      f"{TOPICS[c % len(TOPICS)]}, in two paragraphs."}]


def _run(llm, order: list[int], max_tokens: int, history: dict[int, list[dict]], concurrency: int = 1) -> dict:
    """Serve the turns in ``order``, up to ``concurrency`` at once (a conversation's next turn waits
    for its reply; the queue is served in order, its head waiting when its conversation is busy).
    ``history`` is extended in place with the real replies: every configuration, being lossless and
    batch-invariant, sees the same prompts and gives the same replies whatever ran beside them."""
    from prefixkv import SamplingParams

    eng = llm.engine
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, output_kind="delta")
    returning, outputs, cached, prompt_tokens = [], [None] * len(order), 0, 0
    prompts, returns = [None] * len(order), [False] * len(order)  # (what a peer is given: the same turns)
    last_len: dict[int, int] = {}  # each conversation's tokens after its latest turn
    inflight: dict[str, dict] = {}  # request id -> its turn
    busy: set[int] = set()
    nxt = 0
    t_all = time.perf_counter()
    while nxt < len(order) or inflight:
        while nxt < len(order) and len(inflight) < concurrency and order[nxt] not in busy:
            c = order[nxt]
            msgs = _prompt(history, c)
            ids = eng.tokenizer.apply_chat_template(msgs)
            prompt_tokens += len(ids)
            prompts[nxt], returns[nxt] = list(ids), len(history[c]) > 1
            inflight[f"t{nxt}"] = dict(i=nxt, c=c, msgs=msgs, n=len(ids), k=len(history[c]) // 2, first=None,
                                       toks=[], t0=time.perf_counter())
            eng.add_request(f"t{nxt}", ids, sp)
            busy.add(c)
            nxt += 1
        for out in eng.step():
            turn = inflight[out.request_id]
            if turn["first"] is None and out.outputs[0].delta_token_ids:
                turn["first"] = time.perf_counter() - turn["t0"]
            turn["toks"] += out.outputs[0].delta_token_ids
            if out.finished:
                cached += out.num_cached_tokens
                del inflight[out.request_id]
                c = turn["c"]
                busy.discard(c)
                if turn["k"]:
                    returning.append(turn["first"])
                last_len[c] = turn["n"] + len(turn["toks"])
                outputs[turn["i"]] = turn["toks"]
                history[c] = turn["msgs"] + [{"role": "assistant", "content": eng.tokenizer.decode(turn["toks"])}]
    wall = time.perf_counter() - t_all
    stats = eng.stats()
    q = statistics.quantiles(returning, n=100) if len(returning) > 1 else returning * 99
    return dict(wall_s=round(wall, 2), out_tok_s=round(len(order) * max_tokens / wall, 1),
                returning_ttft_p50_ms=round(statistics.median(returning) * 1e3, 1),
                returning_ttft_p99_ms=round(q[98] * 1e3, 1), prompt_tokens=prompt_tokens, cached_tokens=cached,
                device_hit_tokens=stats["prefix_hit_tokens"] - stats["prefix_host_hit_tokens"],
                lower_tier_hit_tokens=stats["prefix_host_hit_tokens"], host_blocks=stats["num_host_blocks"],
                host_blocks_loaded=stats["host_blocks_loaded"], disk_blocks_used=stats["num_disk_blocks_used"],
                disk_bytes_written=stats["disk_bytes_written"], disk_bytes_read=stats["disk_bytes_read"],
                disk_blocks_prefetched=stats["disk_blocks_prefetched"], disk_sync_reads=stats["disk_sync_reads"],
                disk_admission_waits=stats["disk_admission_waits"], disk_wait_admissions=stats["disk_wait_admissions"],
                disk_wait_s=stats["disk_wait_s"],
                preemptions=stats["num_preemptions"], conversations_kv_tokens=sum(last_len.values()),
                outputs=outputs, turns=[dict(conv=c, prompt=p, returning=r) for c, p, r in zip(order, prompts, returns)])


def _run_vllm(model_path, turns: list[dict], a) -> dict:
    """The same turns (prefixkv's token ids, in the same order, as many at once) through vLLM's CPU
    build in its own interpreter (``bench/vllm_worker.py``'s "turns"), its KV pool the size of
    prefixkv's device pool and no tier below it (vLLM's CPU build has no host offloading); TTFT
    from ``add_request`` to its first streamed token. A process of its own for each call, ended
    before the call returns (an idle vLLM left running would share the cores with what follows)."""
    from types import SimpleNamespace

    from bench.systems import VLLMSystem

    args = SimpleNamespace(kv_tokens=a.device_blocks * 16, dtype="float32", enable_prefix_caching=True,
                           max_num_seqs=max(16, a.concurrency), max_num_batched_tokens=a.max_num_batched_tokens)
    peer = VLLMSystem(f"vllm-b{a.vllm_block_size}", model_path, args, a.vllm_block_size)
    # the device pool's tokens, plus the one block vLLM keeps as its null block
    peer.num_blocks = a.device_blocks * 16 // a.vllm_block_size + 1
    try:
        peer.setup()
        res = peer._call(dict(op="turns", turns=turns, max_tokens=a.max_tokens, concurrency=a.concurrency))
    finally:
        peer.teardown()
    ttft = res["ttft_s"]
    q = statistics.quantiles(ttft, n=100) if len(ttft) > 1 else ttft * 99
    return dict(wall_s=round(res["wall_s"], 2), out_tok_s=round(len(turns) * a.max_tokens / res["wall_s"], 1),
                returning_ttft_p50_ms=round(statistics.median(ttft) * 1e3, 1), returning_ttft_p99_ms=round(q[98] * 1e3, 1),
                prompt_tokens=sum(len(t["prompt"]) for t in turns), cached_tokens=res["cached_tokens"],
                kv_pool_tokens=(peer.num_blocks - 1) * a.vllm_block_size, setup=peer.info(), outputs=res["outputs"])


def _run_hf(model_path, order: list[int], max_tokens: int, history: dict[int, list[dict]], tokenizer) -> dict:
    """The same turns through transformers' ``generate`` (float32, greedy, batch 1: every turn
    recomputes its whole history, the peer a user without a KV cache across requests has); TTFT
    from a streamer's first generated token."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False)  # warm-up

    class FirstToken:
        def __init__(self) -> None:
            self.calls, self.t = 0, None

        def put(self, value) -> None:
            self.calls += 1
            if self.calls == 2 and self.t is None:  # (the first call carries the prompt)
                self.t = time.perf_counter()

        def end(self) -> None:
            pass

    returning, outputs, prompt_tokens = [], [], 0
    t_all = time.perf_counter()
    for c in order:
        k = len(history[c]) // 2
        msgs = _prompt(history, c)
        ids = tokenizer.apply_chat_template(msgs)
        prompt_tokens += len(ids)
        streamer = FirstToken()
        t0 = time.perf_counter()
        with torch.inference_mode():
            gen = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                                 streamer=streamer)
        toks = gen[0, len(ids):].tolist()
        if k:
            returning.append(streamer.t - t0)
        outputs.append(toks)
        history[c] = msgs + [{"role": "assistant", "content": tokenizer.decode(toks)}]
    wall = time.perf_counter() - t_all
    q = statistics.quantiles(returning, n=100) if len(returning) > 1 else returning * 99
    return dict(wall_s=round(wall, 2), out_tok_s=round(len(order) * max_tokens / wall, 1),
                returning_ttft_p50_ms=round(statistics.median(returning) * 1e3, 1),
                returning_ttft_p99_ms=round(q[98] * 1e3, 1), prompt_tokens=prompt_tokens, outputs=outputs)


def _show(name: str, r: dict) -> None:
    print(f"{name}: {json.dumps({k: v for k, v in r.items() if k not in ('outputs', 'turns')})}", flush=True)


def _same(a: list, b: list) -> str:
    return f"{sum(x == y for x, y in zip(a, b))}/{len(b)}"


def _gemma3_shape(a: argparse.Namespace, argv: list[str]) -> int:
    """Returning turns' TTFT on a Gemma-3-shaped model with each tier, windows freed vs every block
    kept, in the same memory (``--device-blocks`` counts whole-model blocks in both)."""
    from bench.run import machine_info, write_result
    from bench.sliding_window import build_model
    from prefixkv import LLM

    order = _order(a.conversations, a.turns, a.seed)
    tmp = Path(tempfile.mkdtemp(prefix="prefixkv-gemma3-tiers-"))
    model_dir = tmp / "model"
    model_dir.mkdir()
    build_model(model_dir, a)
    results = {}
    try:
        for tier in ("host tier", "disk tier (small host tier above it)", "no tier"):
            for kept in (False, True):
                if tier == "no tier" and kept:
                    continue
                kw = dict(model=str(model_dir), dtype="float32", num_kv_blocks=a.device_blocks,
                          max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=max(16, a.concurrency),
                          max_admitted_prefill_tokens=a.max_admitted_prefill_tokens,
                          disable_hybrid_kv_cache_manager=kept)
                disk_dir = tmp / "disk"
                shutil.rmtree(disk_dir, ignore_errors=True)
                if tier == "host tier":
                    kw.update(kv_host_cache_gb=a.host_gb)
                elif tier != "no tier":
                    kw.update(kv_host_cache_gb=a.disk_host_gb, kv_disk_cache_dir=str(disk_dir),
                              kv_disk_cache_gb=a.disk_gb)
                llm = LLM(**kw)
                llm.generate(["warm up"], None)
                name = f"{tier}, {'every block kept' if kept else 'windows freed'}"
                results[name] = _run(llm, order, a.max_tokens, _histories(a.conversations, a.doc_facts), a.concurrency)
                results[name]["kv_groups"] = llm.engine.runner.kv_plan.num_groups
                _show(name, results[name])
                del llm
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    outs = [r["outputs"] for r in results.values()]
    identical = all(o == outs[0] for o in outs)

    def speedup(tier: str) -> float:
        kept, freed = results[f"{tier}, every block kept"], results[f"{tier}, windows freed"]
        return round(kept["returning_ttft_p50_ms"] / freed["returning_ttft_p50_ms"], 2)

    base = results["no tier, windows freed"]["returning_ttft_p50_ms"]
    summary = dict(returning_ttft_p50_freed_vs_kept_host=speedup("host tier"),
                   returning_ttft_p50_freed_vs_kept_disk=speedup("disk tier (small host tier above it)"),
                   **{f"returning_ttft_p50_speedup_vs_no_tier: {n}": round(base / r["returning_ttft_p50_ms"], 2)
                      for n, r in results.items() if not n.startswith("no tier")},
                   outputs_identical=identical)
    print("summary:", json.dumps(summary))
    for r in results.values():
        r.pop("outputs")
        r.pop("turns", None)
    doc = dict(workload="tiers-gemma3-shape", command="python -m bench.tiers " + " ".join(argv), params=vars(a),
               machine=machine_info(a.threads), results=results, summary=summary, num_turns=len(order))
    path = write_result(doc, a.out, f"tiers-gemma3-shape-{time.strftime('%Y%m%d-%H%M%S')}")
    print(f"wrote {path}")
    return 0 if identical else 1


def main(argv: list[str] | None = None) -> int:
    import sys

    argv = sys.argv[1:] if argv is None else argv  # (recorded in the JSON's command)
    from prefixkv.engine_args import admitted_prefill_tokens

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--device-blocks", type=int, default=64, help="the device pool (16-token blocks)")
    p.add_argument("--host-gb", type=float, default=0.5)
    p.add_argument("--disk-host-gb", type=float, default=0.05, help="the host tier above the disk tier")
    p.add_argument("--disk-gb", type=float, default=1.0)
    p.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    p.add_argument("--vllm", action="store_true",
                   help="add vLLM's CPU build as a peer (its virtualenv from tools/peer-vllm-cpu)")
    p.add_argument("--vllm-block-size", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--doc-facts", type=int, default=60, help="length of each conversation's system prompt")
    p.add_argument("--concurrency", type=int, default=1,
                   help="turns served at once (of different conversations), as a chat backend with several users")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-admitted-prefill-tokens", type=admitted_prefill_tokens, default="auto",
                   help="prefixkv's max_admitted_prefill_tokens, in every configuration: auto (the engine's "
                        "default), none or an int")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "out"))
    p.add_argument("--gemma3-shape", action="store_true",
                   help="a Gemma-3-shaped model, windows freed vs every block kept, with each tier")
    p.add_argument("--window", type=int, default=256, help="--gemma3-shape: the sliding layers' window")
    p.add_argument("--layers", type=int, default=12, help="--gemma3-shape: layers")
    p.add_argument("--hidden", type=int, default=256, help="--gemma3-shape: hidden size")
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    if a.gemma3_shape:
        return _gemma3_shape(a, argv)
    from bench.run import machine_info, write_result
    from prefixkv import LLM

    results = {}
    order = _order(a.conversations, a.turns, a.seed)
    disk_dir = Path(tempfile.mkdtemp(prefix="prefixkv-tiers-"))

    def make(name: str):
        kw = dict(model=None, dtype="float32", num_kv_blocks=a.device_blocks,
                  max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=max(16, a.concurrency),
                  max_admitted_prefill_tokens=a.max_admitted_prefill_tokens)
        if name == "host tier":
            kw.update(kv_host_cache_gb=a.host_gb)
        elif name.startswith("disk tier"):
            kw.update(kv_host_cache_gb=a.disk_host_gb, kv_disk_cache_dir=str(disk_dir), kv_disk_cache_gb=a.disk_gb)
        llm = LLM(**kw)
        llm.generate(["warm up"], None, use_tqdm=False)
        return llm

    for name in ("recompute (no tier)", "host tier", "disk tier (small host tier above it)"):
        llm = make(name)
        results[name] = _run(llm, order, a.max_tokens, _histories(a.conversations, a.doc_facts), a.concurrency)
        _show(name, results[name])
    if not a.no_hf:
        results["transformers generate"] = _run_hf(llm.engine.model_path, order, a.max_tokens,
                                                   _histories(a.conversations, a.doc_facts), llm.engine.tokenizer)
        _show("transformers generate", results["transformers generate"])
    model_path = llm.engine.model_path
    del llm
    if a.vllm:  # the same turns (the recompute run's prompts) through vLLM's CPU build
        results["vLLM CPU"] = _run_vllm(model_path, results["recompute (no tier)"]["turns"], a)
        _show("vLLM CPU", results["vLLM CPU"])
    shutil.rmtree(disk_dir)
    disk_dir.mkdir()
    # restart: every turn but each conversation's last, a clean shutdown, a new engine on the same
    # directory serves the last turns; against a fresh engine without tiers on the same prompts
    last = {c: max(i for i, x in enumerate(order) if x == c) for c in set(order)}
    before = [c for i, c in enumerate(order) if i != last[c]]
    after = [c for i, c in enumerate(order) if i == last[c]]
    hist = _histories(a.conversations, a.doc_facts)
    first = make("disk tier")
    _run(first, before, a.max_tokens, hist, a.concurrency)
    first.close()
    del first
    hist_copy = {c: list(m) for c, m in hist.items()}
    results["restart: disk tier"] = _run(make("disk tier"), after, a.max_tokens, hist, a.concurrency)
    results["restart: recompute"] = _run(make("recompute (no tier)"), after, a.max_tokens, hist_copy, a.concurrency)
    if a.vllm:  # the restart's last turns on a new vLLM process
        results["restart: vLLM CPU"] = _run_vllm(model_path, results["restart: recompute"]["turns"], a)
    for name in ("restart: disk tier", "restart: recompute") + (("restart: vLLM CPU",) if a.vllm else ()):
        _show(name, results[name])
    shutil.rmtree(disk_dir, ignore_errors=True)
    base, tier, disk = (results[k] for k in ("recompute (no tier)", "host tier", "disk tier (small host tier above it)"))
    r_disk, r_base = results["restart: disk tier"], results["restart: recompute"]
    identical = base["outputs"] == tier["outputs"] == disk["outputs"] and r_disk["outputs"] == r_base["outputs"]
    summary = dict(returning_ttft_p50_speedup_host=round(base["returning_ttft_p50_ms"] / tier["returning_ttft_p50_ms"], 2),
                   returning_ttft_p50_speedup_disk=round(base["returning_ttft_p50_ms"] / disk["returning_ttft_p50_ms"], 2),
                   throughput_ratio_host=round(tier["out_tok_s"] / base["out_tok_s"], 2),
                   throughput_ratio_disk=round(disk["out_tok_s"] / base["out_tok_s"], 2),
                   restart_first_turn_ttft_p50_speedup=round(r_base["returning_ttft_p50_ms"]
                                                             / r_disk["returning_ttft_p50_ms"], 2),
                   outputs_identical=identical, device_pool_tokens=a.device_blocks * 16,
                   **({} if a.no_hf else dict(
                       returning_ttft_p50_speedup_host_vs_transformers=round(
                           results["transformers generate"]["returning_ttft_p50_ms"] / tier["returning_ttft_p50_ms"], 2),
                       throughput_ratio_host_vs_transformers=round(
                           tier["out_tok_s"] / results["transformers generate"]["out_tok_s"], 2),
                       transformers_outputs_identical_turns=sum(
                           x == y for x, y in zip(results["transformers generate"]["outputs"], base["outputs"])))),
                   **({} if not a.vllm else dict(
                       returning_ttft_p50_speedup_host_vs_vllm=round(
                           results["vLLM CPU"]["returning_ttft_p50_ms"] / tier["returning_ttft_p50_ms"], 2),
                       returning_ttft_p50_speedup_disk_vs_vllm=round(
                           results["vLLM CPU"]["returning_ttft_p50_ms"] / disk["returning_ttft_p50_ms"], 2),
                       throughput_ratio_host_vs_vllm=round(tier["out_tok_s"] / results["vLLM CPU"]["out_tok_s"], 2),
                       throughput_ratio_recompute_vs_vllm=round(base["out_tok_s"] / results["vLLM CPU"]["out_tok_s"], 2),
                       restart_ttft_p50_speedup_disk_vs_vllm=round(
                           results["restart: vLLM CPU"]["returning_ttft_p50_ms"] / r_disk["returning_ttft_p50_ms"], 2),
                       vllm_outputs_identical_turns=_same(results["vLLM CPU"]["outputs"], base["outputs"]),
                       vllm_restart_outputs_identical_turns=_same(results["restart: vLLM CPU"]["outputs"],
                                                                  r_base["outputs"]))),
                   prompt_tokens_served=base["prompt_tokens"], conversations_kv_tokens=base["conversations_kv_tokens"])
    print("summary:", json.dumps(summary))
    for r in results.values():
        r.pop("outputs")
        r.pop("turns", None)
    doc = dict(workload="tiers", command="python -m bench.tiers " + " ".join(argv or []), params=vars(a),
               machine=machine_info(a.threads), results=results, summary=summary, num_turns=len(order))
    path = write_result(doc, a.out, f"tiers-{time.strftime('%Y%m%d-%H%M%S')}")
    print(f"wrote {path}")
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
