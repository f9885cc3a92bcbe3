"""GPU benchmarks for tools/gpu_check (needs CUDA and CuPy). Writes one JSON.

1. device copy bandwidth (a large device-to-device copy, bytes read + written / time);
2. paged decode attention at batch 64, context 4096, bf16, head_dim 128, GQA 4:1 (32 q / 8 kv
   heads), block size 16: KV bytes read / kernel time, and its fraction of the copy bandwidth;
3. end-to-end decode throughput on a Llama-1B-shaped random-weight model in bf16: prefixkv against
   transformers' ``generate`` (static batch) and ``generate_batch`` (continuous batching) in the
   same run, same weights, same prompts, greedy, no eos;
4. CUDA-graph capture time for all buckets, and decode step time with graphs vs eager at batch 8.

Every figure here comes from this run; a peer that fails is recorded with its error, never guessed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def cuda_time(fn, iters: int, warmup: int = 3) -> float:
    """Mean seconds per call, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / iters


def copy_bandwidth() -> dict:
    n = 1 << 30  # 1 GiB
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src), 20)
    return {"bytes": n, "seconds": t, "gb_per_s": 2 * n / t / 1e9}


def decode_attention(copy_gbps: float) -> dict:
    from prefixkv.attention.cuda import paged_decode_attention

    batch, ctx, heads, kv_heads, head_dim, bs = 64, 4096, 32, 8, 128, 16
    blocks_per_seq = ctx // bs
    num_blocks = batch * blocks_per_seq
    cache = torch.randn((2, num_blocks + 1, kv_heads, bs, head_dim), dtype=torch.bfloat16, device="cuda")
    perm = torch.randperm(num_blocks, device="cuda").to(torch.int32)
    tables = perm.view(batch, blocks_per_seq).contiguous()
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn((batch, heads, head_dim), dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    res = {"batch": batch, "context": ctx, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim,
           "block_size": bs, "dtype": "bfloat16"}
    kv_bytes = 2 * batch * ctx * kv_heads * head_dim * 2
    for split in (False, True):
        t = cuda_time(lambda: paged_decode_attention(q, cache, tables, seq_lens, head_dim ** -0.5, ctx,
                                                     out=out, split_k=split), 50)
        gbps = kv_bytes / t / 1e9
        res["split_k" if split else "no_split"] = {"seconds": t, "gb_per_s": gbps,
                                                   "fraction_of_copy_bw": gbps / copy_gbps}
    res["kv_bytes"] = kv_bytes
    return res


def llama_1b(path: Path) -> Path:
    import transformers

    from tiny_models import build_tokenizer

    vocab = 32000
    build_tokenizer(path)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                   max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=2,
                                   bos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(path), safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    return path


def e2e(path: Path, batch: int, prompt_len: int, out_len: int) -> dict:
    from prefixkv import LLM, SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 380) for _ in range(prompt_len)] for _ in range(batch)]
    res: dict = {"batch": batch, "prompt_len": prompt_len, "output_len": out_len, "model": "Llama-1B-shaped bf16"}
    total = batch * out_len

    t0 = time.perf_counter()
    llm = LLM(model=str(path), device="cuda", dtype="bfloat16", max_num_seqs=batch, block_size=16,
              max_num_batched_tokens=4096, kv_cache_memory_bytes=8 << 30)
    res["prefixkv_load_seconds"] = time.perf_counter() - t0
    res["graph_capture_seconds"] = llm.engine.graph_capture_seconds
    res["graph_buckets"] = llm.engine.runner.graphs.buckets if llm.engine.runner.graphs else None
    sp = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, detokenize=False))  # warm-up
    llm.engine.scheduler.kv.radix.reset()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    ours = llm.generate(prompts, sp)
    torch.cuda.synchronize()
    t = time.perf_counter() - t0
    res["prefixkv"] = {"seconds": t, "output_tokens_per_s": total / t}
    ours_ids = [o.token_ids for o in ours]
    del llm
    torch.cuda.empty_cache()

    from transformers import AutoModelForCausalLM, GenerationConfig

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).cuda().eval()
    try:
        ids = torch.tensor(prompts, device="cuda")
        gen = dict(max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False, pad_token_id=0)
        hf.generate(ids[:2, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), **gen)
        torch.cuda.synchronize()
        t = time.perf_counter() - t0
        hf_ids = out[:, prompt_len:].tolist()
        res["hf_generate"] = {"seconds": t, "output_tokens_per_s": total / t,
                              "greedy_match_fraction": sum(a == b for a, b in zip(ours_ids, hf_ids)) / batch}
    except Exception as e:  # noqa: BLE001 - a failing peer is recorded, not fatal
        res["hf_generate"] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
    try:
        cfg = GenerationConfig(max_new_tokens=out_len, do_sample=False, eos_token_id=None, pad_token_id=0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = hf.generate_batch(inputs=prompts, generation_config=cfg)
        torch.cuda.synchronize()
        t = time.perf_counter() - t0
        n_tok = sum(len(o.generated_tokens) for o in outs.values())
        res["hf_generate_batch"] = {"seconds": t, "output_tokens_per_s": n_tok / t, "output_tokens": n_tok}
    except Exception as e:  # noqa: BLE001
        res["hf_generate_batch"] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
    del hf
    torch.cuda.empty_cache()
    for peer in ("hf_generate", "hf_generate_batch"):
        if "output_tokens_per_s" in res.get(peer, {}):
            res[f"ratio_vs_{peer}"] = res["prefixkv"]["output_tokens_per_s"] / res[peer]["output_tokens_per_s"]
    return res


def graph_vs_eager(path: Path, batch: int = 8, out_len: int = 64) -> dict:
    from prefixkv import LLM, SamplingParams

    rng = random.Random(1)
    prompts = [[rng.randrange(3, 380) for _ in range(32)] for _ in range(batch)]
    res = {"batch": batch}
    for name, eager in (("eager", True), ("graphs", False)):
        llm = LLM(model=str(path), device="cuda", dtype="bfloat16", max_num_seqs=16, enforce_eager=eager,
                  kv_cache_memory_bytes=2 << 30)
        eng = llm.engine
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True,
                                                       detokenize=False))
        eng.step()  # prefill
        times = []
        while eng.has_unfinished():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            eng.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        times = sorted(times[2:])  # drop warm-up steps
        res[name] = {"median_step_seconds": times[len(times) // 2], "steps": len(times)}
        del llm, eng
        torch.cuda.empty_cache()
    res["graph_speedup"] = res["eager"]["median_step_seconds"] / res["graphs"]["median_step_seconds"]
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "date": time.strftime("%Y-%m-%d")}
    try:
        import cupy
        import transformers

        result["cupy"], result["transformers"] = cupy.__version__, transformers.__version__
    except Exception as e:  # noqa: BLE001
        result["import_error"] = str(e)

    def section(name, fn, *a):
        t0 = time.perf_counter()
        try:
            result[name] = fn(*a)
        except Exception as e:  # noqa: BLE001
            result[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        result[name + "_wall_seconds"] = time.perf_counter() - t0
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"[gpu_bench] {name}: {json.dumps(result[name])[:600]}", flush=True)

    section("copy_bandwidth", copy_bandwidth)
    copy_gbps = result["copy_bandwidth"].get("gb_per_s", float("nan"))
    section("decode_attention", decode_attention, copy_gbps)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d)
        section("model_build", lambda: str(llama_1b(path)))
        section("e2e_decode", e2e, path, args.batch, args.prompt_len, args.output_len)
        section("graph_vs_eager", graph_vs_eager, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
