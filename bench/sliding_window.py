"""``python -m bench sliding-window``: long multi-turn chats on a Gemma-3-shaped model in a fixed KV
budget, with the sliding-window layers' out-of-window blocks freed (KV cache groups, the default)
and without (``disable_hybrid_kv_cache_manager``), same weights, same traffic, same command.

The model: Gemma 3's text architecture at a small size (random weights, float32, the embedded
model's tokenizer), every sixth layer global and the others a sliding window of ``--window``
tokens, as Gemma 3 ships. The traffic: ``--conversations`` chats of ``--turns`` turns; each turn
resends the whole conversation plus a new user message (``--user-tokens``) and generates
``--output-tokens`` greedy tokens; all conversations' turn k run together (one ``generate``).
Reported per mode: wall time, output tokens/s, the most requests running at once, preemptions,
prefix-cache hit fraction; and whether both modes gave the same tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=256)
    p.add_argument("--user-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--window", type=int, default=256, help="the sliding layers' window (Gemma 3: 512-1024)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--kv-budget-mb", type=float, default=48.0, help="KV cache memory, the same for both modes")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--repeat", type=int, default=1, help="runs per mode, alternating; medians reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "out"))


def build_model(path: Path, args: argparse.Namespace) -> int:
    """A Gemma-3-shaped float32 checkpoint in ``path`` with the embedded model's tokenizer."""
    import torch
    import transformers

    from prefixkv.model.loader import resolve_model

    src = resolve_model(None)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")) or f.name == "generation_config.json":
            shutil.copy(f, path / f.name)
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    vocab = len(tok)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
        sliding_window=args.window, sliding_window_pattern=6, query_pre_attn_scalar=64,
        max_position_embeddings=16384, tie_word_embeddings=True, bos_token_id=tok.bos_token_id or 1,
        eos_token_id=tok.eos_token_id or 2, pad_token_id=tok.pad_token_id or 0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}})
    torch.manual_seed(args.seed)
    model = transformers.Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.25)
            elif name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
    model.save_pretrained(str(path), safe_serialization=True)
    return vocab


def run_mode(model_dir: Path, args: argparse.Namespace, vocab: int, disable: bool) -> dict:
    from prefixkv import LLM, SamplingParams

    llm = LLM(model=str(model_dir), dtype="float32", block_size=args.block_size,
              kv_cache_memory_bytes=int(args.kv_budget_mb * (1 << 20)), max_num_seqs=args.max_num_seqs,
              disable_hybrid_kv_cache_manager=disable)
    eng = llm.engine
    rng = random.Random(args.seed)
    convs = [[rng.randrange(3, vocab) for _ in range(args.system_tokens)] for _ in range(args.conversations)]
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    peak, outputs, num_out = 0, [], 0
    t0 = time.perf_counter()
    for _ in range(args.turns):
        prompts = [c + [rng.randrange(3, vocab) for _ in range(args.user_tokens)] for c in convs]
        for i, p in enumerate(prompts):
            eng.add_request(f"t{len(outputs)}-{i}", p, params)
        done = {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0].token_ids
            peak = max(peak, eng.scheduler.num_running)
        turn = [done[f"t{len(outputs)}-{i}"] for i in range(len(prompts))]
        outputs.append(turn)
        num_out += sum(len(t) for t in turn)
        convs = [p + t for p, t in zip(prompts, turn)]
    wall = time.perf_counter() - t0
    kv = eng.scheduler.kv
    return {"mode": "blocks kept (one group)" if disable else "out-of-window blocks freed (KV cache groups)",
            "disable_hybrid_kv_cache_manager": disable, "kv_groups": eng.runner.kv_plan.num_groups,
            "layers_per_page": eng.runner.kv_plan.layers_per_page, "num_pages": kv.num_blocks,
            "wall_s": round(wall, 3), "output_tokens": num_out, "output_tokens_per_s": round(num_out / wall, 1),
            "peak_running": peak, "preemptions": eng.scheduler.num_preemptions,
            "prefix_hit_fraction": round(kv.num_hit_tokens / max(kv.num_queried_tokens, 1), 4),
            "final_conversation_tokens": max(len(c) for c in convs), "outputs": outputs}


def cmd_sliding_window(args: argparse.Namespace, command: str) -> int:
    import statistics

    from bench.run import machine_info

    tmp = Path(tempfile.mkdtemp(prefix="prefixkv-gemma3-shape-"))
    try:
        vocab = build_model(tmp, args)
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(args.repeat):
            for disable in (False, True):
                r = run_mode(tmp, args, vocab, disable)
                runs[disable].append(r)
                print(f"{r['mode']:>45}: {r['wall_s']:7.2f} s, {r['output_tokens_per_s']:7.1f} tok/s, peak "
                      f"{r['peak_running']} running, {r['preemptions']} preemptions, hit {r['prefix_hit_fraction']}",
                      flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    same = all(a["outputs"] == b["outputs"] for a in runs[False] for b in runs[True])
    med = {d: statistics.median(r["output_tokens_per_s"] for r in rs) for d, rs in runs.items()}
    summary = {"throughput_x": round(med[False] / med[True], 3),
               "peak_running_x": round(runs[False][0]["peak_running"] / max(runs[True][0]["peak_running"], 1), 3),
               "outputs_identical": same}
    print(f"freed vs kept: throughput {summary['throughput_x']}x, requests at once {summary['peak_running_x']}x, "
          f"outputs identical: {same}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"sliding-window-{time.strftime('%Y%m%d-%H%M%S')}.json"
    params = {k: v for k, v in vars(args).items() if k != "out"}
    path.write_text(json.dumps({"command": command, "machine": machine_info(args.threads), "params": params,
                                "summary": summary,
                                "runs": {("kept" if d else "freed"): [{k: v for k, v in r.items() if k != "outputs"}
                                                                      for r in rs] for d, rs in runs.items()}},
                               indent=1))
    print(f"wrote {path}")
    return 0 if same else 1
