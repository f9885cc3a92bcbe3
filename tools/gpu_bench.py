"""GPU benchmarks for tools/gpu_check (needs CUDA and CuPy). One JSON, updated after every section.

    python tools/gpu_bench.py --out OUT.json --phase micro|model|e2e|graphs [--model-dir DIR]

Phases (tools/gpu_check runs each in its own process under its own time limit; each merges its
sections into OUT.json as soon as they finish, so a phase that is cut short keeps what it measured):

  micro   device copy bandwidth (a 1 GiB device-to-device copy, bytes read + written / time), and
          paged decode attention at batch 64, context 4096, bf16, head_dim 128, GQA 4:1 (32 q / 8 kv
          heads), block size 16: KV bytes read / kernel time, as a fraction of the copy bandwidth
          (plain, split-K and the backend's automatic choice; output checked against torch);
  model   a Llama-1B-shaped random-weight model (16 layers, hidden 2048, 32/8 heads, head_dim 64,
          vocab 32000) saved in bf16 to --model-dir (outside $OUT: it is 2 GiB);
  e2e     end-to-end greedy decode throughput on that model, same prompts, same weights, no eos:
          prefixkv (CUDA graphs) against transformers' ``generate`` (static batch) and
          ``generate_batch`` (continuous batching) in the same process;
  graphs  CUDA-graph capture time of all buckets (max_num_seqs 64), and decode time with graphs
          against eager (--enforce-eager) at batch 1, 8 and 32: the model forward alone (replay vs
          eager call on the same inputs) and whole engine steps.

Every figure comes from this run; a peer that fails is recorded with its error, never guessed.
``summary`` compares the figures present with the targets of issue 7.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import random
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

TARGETS = {  # issue 7
    "decode_attention_fraction_of_copy_bw": 0.70,
    "graph_capture_all_buckets_seconds": 3.0,
    "graph_speedup_batch8": 1.5,
    "e2e_ratio_vs_hf_generate_batch": 2.0,
}


class Results:
    """The JSON file: read at start (earlier phases' sections), rewritten after every section."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict = json.loads(path.read_text()) if path.is_file() else {}

    def section(self, name: str, fn, *args):
        t0 = time.perf_counter()
        try:
            value = fn(*args)
        except Exception as e:  # noqa: BLE001 - recorded (beside any partial results), the next section runs
            partial = self.data.get(name) if isinstance(self.data.get(name), dict) else {}
            value = {**partial, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        self.data[name] = value
        self.data.setdefault("wall_seconds", {})[name] = round(time.perf_counter() - t0, 2)
        self.save()
        print(f"[gpu_bench] {name} ({time.perf_counter() - t0:.1f}s): {json.dumps(value)[:700]}", flush=True)
        return value

    def update(self, name: str, **values) -> None:
        """Partial results of a section still running."""
        self.data.setdefault(name, {}).update(values)
        self.save()

    def save(self) -> None:
        self.data["summary"] = summary(self.data)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        os.replace(tmp, self.path)


def _get(d: dict, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def summary(data: dict) -> dict:
    """Each target with the value this run measured (None: not measured) and whether it is met."""
    best_frac = max((v for v in (_get(data, "decode_attention", k, "fraction_of_copy_bw")
                                 for k in ("no_split", "split_k", "auto")) if v is not None), default=None)
    values = {
        "decode_attention_fraction_of_copy_bw": best_frac,
        "graph_capture_all_buckets_seconds": _get(data, "cuda_graphs", "capture_seconds")
        or _get(data, "e2e_decode", "prefixkv_graphs", "capture_seconds"),
        "graph_speedup_batch8": _get(data, "cuda_graphs", "batch_8", "engine_step_speedup"),
        "e2e_ratio_vs_hf_generate_batch": _get(data, "e2e_decode", "ratio_vs_hf_generate_batch"),
    }
    out = {}
    for name, target in TARGETS.items():
        v = values[name]
        met = None if v is None else (v <= target if name.endswith("seconds") else v >= target)
        out[name] = {"value": v, "target": target, "met": met}
    return out


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


def free_memory() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


# ---- environment -------------------------------------------------------------------------------


def environment() -> dict:
    props = torch.cuda.get_device_properties(0)
    env = {"device": torch.cuda.get_device_name(), "capability": f"{props.major}.{props.minor}",
           "num_sms": props.multi_processor_count, "memory_gib": round(props.total_memory / 2**30, 1),
           "torch": torch.__version__, "torch_cuda": torch.version.cuda, "python": sys.version.split()[0],
           "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    for mod in ("cupy", "transformers"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            env[mod] = f"unavailable: {e}"
    try:
        import cupy

        env["nvrtc"] = ".".join(map(str, cupy.cuda.nvrtc.getVersion()))
        env["cuda_driver"] = cupy.cuda.runtime.driverGetVersion()
    except Exception as e:  # noqa: BLE001
        env["nvrtc"] = f"unavailable: {e}"
    return env


# ---- micro: copy and decode-attention bandwidth ------------------------------------------------


def copy_bandwidth() -> dict:
    n = 1 << 30  # 1 GiB
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src), 20)
    del src, dst
    free_memory()
    return {"bytes": n, "seconds": t, "gb_per_s": 2 * n / t / 1e9, "counted": "bytes read + bytes written"}


def decode_attention(copy_gbps: float | None) -> dict:
    from prefixkv.attention.cuda import paged_decode_attention
    from prefixkv.attention.torch_ref import gather_kv

    batch, ctx, heads, kv_heads, head_dim, bs = 64, 4096, 32, 8, 128, 16
    blocks_per_seq = ctx // bs
    num_blocks = batch * blocks_per_seq
    cache = torch.randn((2, num_blocks + 1, kv_heads, bs, head_dim), dtype=torch.bfloat16, device="cuda")
    perm = torch.randperm(num_blocks, device="cuda").to(torch.int32)
    tables = perm.view(batch, blocks_per_seq).contiguous()
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn((batch, heads, head_dim), dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    scale = head_dim ** -0.5
    kv_bytes = 2 * batch * ctx * kv_heads * head_dim * 2  # K and V, bf16
    res = {"batch": batch, "context": ctx, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim,
           "block_size": bs, "dtype": "bfloat16", "kv_bytes": kv_bytes, "copy_gb_per_s": copy_gbps}
    # correctness at this shape: two sequences against torch on the gathered K/V (float32)
    paged_decode_attention(q, cache, tables, seq_lens, scale, ctx, out=out)
    errs = []
    for s in (0, batch - 1):
        k, v = (x.float().repeat_interleave(heads // kv_heads, 0) for x in gather_kv(cache, tables[s].long(), ctx))
        p = torch.softmax(torch.einsum("hd,hld->hl", q[s].float(), k) * scale, dim=-1)
        errs.append((torch.einsum("hl,hld->hd", p, v) - out[s].float()).abs().max().item())
    res["max_abs_err_vs_torch"] = max(errs)
    for name, split in (("no_split", False), ("split_k", True), ("auto", None)):
        t = cuda_time(lambda: paged_decode_attention(q, cache, tables, seq_lens, scale, ctx, out=out,
                                                     split_k=split), 50)
        gbps = kv_bytes / t / 1e9
        res[name] = {"seconds": t, "gb_per_s": gbps,
                     "fraction_of_copy_bw": gbps / copy_gbps if copy_gbps else None}
    del cache, q, out
    free_memory()
    return res


# ---- model -------------------------------------------------------------------------------------


def build_llama_1b(path: Path) -> dict:
    import transformers

    from tiny_models import build_tokenizer

    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return {"path": str(path), "reused": True}
    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer(path)
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                   max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=2,
                                   bos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(str(path))
    del model
    free_memory()
    return {"path": str(path), "num_params": n_params, "reused": False}


def _prompts(batch: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 380) for _ in range(prompt_len)] for _ in range(batch)]


def _graph_info(llm) -> dict:
    g = llm.engine.runner.graphs
    if g is None:
        return {"graphs": None}
    return {"buckets": g.buckets, "capture_seconds": g.capture_seconds, "warmup_seconds": g.warmup_seconds,
            "bucket_seconds": {str(b): round(s, 4) for b, s in sorted(g.bucket_seconds.items())}}


# ---- e2e ---------------------------------------------------------------------------------------


def e2e(results: Results, path: Path, batch: int, prompt_len: int, out_len: int) -> dict:
    from prefixkv import LLM, SamplingParams

    prompts = _prompts(batch, prompt_len)
    total = batch * out_len
    res: dict = {"batch": batch, "prompt_len": prompt_len, "output_len": out_len, "model": "Llama-1B-shaped bf16",
                 "timed": "wall time of the whole batch (prefill included), after a warm-up"}
    t0 = time.perf_counter()
    llm = LLM(model=str(path), device="cuda", dtype="bfloat16", max_num_seqs=batch, block_size=16,
              max_num_batched_tokens=4096, kv_cache_memory_bytes=8 << 30)
    res["prefixkv_load_seconds"] = time.perf_counter() - t0
    res["prefixkv_graphs"] = _graph_info(llm)
    sp = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate(_prompts(2, 16, seed=9), SamplingParams(max_tokens=4, temperature=0.0, detokenize=False))
    radix = getattr(llm.engine.scheduler.kv, "radix", None)
    if radix is not None:
        radix.reset()  # no prefix-cache hits from the warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    ours = llm.generate(prompts, sp)
    torch.cuda.synchronize()
    t = time.perf_counter() - t0
    res["prefixkv"] = {"seconds": t, "output_tokens_per_s": total / t}
    ours_ids = [o.token_ids for o in ours]
    results.update("e2e_decode", **res)
    del llm, ours
    free_memory()

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).cuda().eval()
    try:
        ids = torch.tensor(prompts, device="cuda")
        hf.generate(ids[:2, :8], attention_mask=torch.ones_like(ids[:2, :8]), max_new_tokens=4, do_sample=False,
                    pad_token_id=0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len, min_new_tokens=out_len,
                          do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        t = time.perf_counter() - t0
        hf_ids = out[:, prompt_len:].tolist()
        res["hf_generate"] = {"seconds": t, "output_tokens_per_s": total / t,
                              "greedy_match_fraction": sum(a == b for a, b in zip(ours_ids, hf_ids)) / batch}
    except Exception as e:  # noqa: BLE001 - a failing peer is recorded, not fatal
        res["hf_generate"] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
    results.update("e2e_decode", **res)
    res["hf_generate_batch"] = hf_generate_batch(hf, prompts, out_len, ours_ids)
    del hf
    free_memory()
    for peer in ("hf_generate", "hf_generate_batch"):
        if "output_tokens_per_s" in res.get(peer, {}):
            res[f"ratio_vs_{peer}"] = res["prefixkv"]["output_tokens_per_s"] / res[peer]["output_tokens_per_s"]
    return res


def hf_generate_batch(hf, prompts: list[list[int]], out_len: int, ours_ids: list[list[int]]) -> dict:
    """transformers' continuous batching, called with only the arguments this version accepts
    (its signature changed across 5.x); eos disabled (-1) as in bench/systems.py."""
    from transformers import GenerationConfig

    if not hasattr(hf, "generate_batch"):
        return {"error": "this transformers has no generate_batch"}
    params = inspect.signature(hf.generate_batch).parameters
    res: dict = {"signature": str(inspect.signature(hf.generate_batch))[:400]}
    kwargs = {k: v for k, v in (("progress_bar", False),) if k in params}
    try:
        gen = GenerationConfig(max_new_tokens=out_len, do_sample=False, eos_token_id=-1, pad_token_id=0)
        runs = []
        for _ in range(2):  # the first call also sets up the manager (and, in newer versions, graphs)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = hf.generate_batch(inputs=prompts, generation_config=gen, **kwargs)
            torch.cuda.synchronize()
            runs.append(time.perf_counter() - t0)
            if runs[-1] > 10:  # slow enough that its set-up hardly matters; keep time for the rest
                break
        results = list(outs.values()) if isinstance(outs, dict) else list(outs)
        n_tok = sum(len(getattr(o, "generated_tokens", [])) for o in results)
        t = min(runs)
        res.update(seconds=t, call_seconds=runs, output_tokens=n_tok, output_tokens_per_s=n_tok / t)
        errors = [str(o.error) for o in results if getattr(o, "error", None) is not None]
        if n_tok != len(prompts) * out_len or errors:
            res["warning"] = f"{n_tok} tokens generated, {len(prompts) * out_len} expected; errors: {errors[:3]}"
        # results may come back in any order: match them to our outputs by prompt
        by_prompt = {tuple(getattr(o, "prompt_ids", ())): list(o.generated_tokens) for o in results}
        theirs = [by_prompt.get(tuple(p)) for p in prompts]
        if all(x is not None for x in theirs):
            res["greedy_match_fraction"] = sum(a == b for a, b in zip(ours_ids, theirs)) / len(prompts)
    except Exception as e:  # noqa: BLE001
        res.update(error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:])
    return res


# ---- graphs ------------------------------------------------------------------------------------


def _decode_meta(n: int, ctx: int, block_size: int, max_seq_len: int):
    """A decode step of n sequences with ctx tokens each, in disjoint fresh blocks."""
    from prefixkv.attention import AttentionMetadata

    nb = -(-ctx // block_size)
    tables = torch.arange(n * nb, dtype=torch.int32, device="cuda").view(n, nb)
    pos = ctx - 1
    slots = tables[:, pos // block_size].long() * block_size + pos % block_size
    return AttentionMetadata(slot_mapping=slots, query_start_loc=torch.arange(n + 1, dtype=torch.int32, device="cuda"),
                             seq_lens=torch.full((n,), ctx, dtype=torch.int32, device="cuda"), block_tables=tables,
                             num_decode_seqs=n, max_seq_len=max_seq_len, max_query_len=1)


def graphs(results: Results, path: Path, batches=(1, 8, 32), ctx: int = 256, steps: int = 48) -> dict:
    from prefixkv import LLM, SamplingParams

    res: dict = {"context": ctx}
    kw = dict(model=str(path), device="cuda", dtype="bfloat16", max_num_seqs=64, block_size=16,
              max_num_batched_tokens=2048, kv_cache_memory_bytes=2 << 30)
    llms = {}
    for name, eager in (("graphs", False), ("eager", True)):
        t0 = time.perf_counter()
        llms[name] = LLM(enforce_eager=eager, **kw)
        res[f"{name}_load_seconds"] = time.perf_counter() - t0
    res.update(_graph_info(llms["graphs"]))
    results.update("cuda_graphs", **res)
    for b in batches:
        row: dict = {}
        # the model forward alone: replay vs the eager call, same inputs
        runner = llms["graphs"].engine.runner
        g = runner.graphs
        meta = _decode_meta(b, ctx, g.block_size, g.max_model_len)
        ids = torch.randint(3, 380, (b,), device="cuda")
        pos = torch.full((b,), ctx - 1, dtype=torch.int64, device="cuda")
        rows = torch.arange(b, device="cuda")
        with torch.inference_mode():
            t_graph = cuda_time(lambda: g.replay(ids, pos, meta), 30)
            t_eager = cuda_time(lambda: runner.model(ids, pos, runner.kv_cache, [meta] * len(runner.kv_cache), runner.backend, rows), 30)
        row["forward_graph_seconds"], row["forward_eager_seconds"] = t_graph, t_eager
        row["forward_speedup"] = t_eager / t_graph
        # whole engine steps (scheduler, inputs, sampling included)
        for name, llm in llms.items():
            eng = llm.engine
            for i, p in enumerate(_prompts(b, 32, seed=b)):
                eng.add_request(f"b{b}-{i}", p, SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True,
                                                               detokenize=False))
            eng.step()  # prefill
            times = []
            while eng.has_unfinished():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                eng.step()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            times = sorted(times[2:])
            row[f"engine_step_{name}_median_seconds"] = times[len(times) // 2]
        row["engine_step_speedup"] = row["engine_step_eager_median_seconds"] / row["engine_step_graphs_median_seconds"]
        res[f"batch_{b}"] = row
        results.update("cuda_graphs", **res)
    del llms
    free_memory()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--phase", required=True, choices=["micro", "model", "e2e", "graphs"])
    ap.add_argument("--model-dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "prefixkv-llama-1b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA device", file=sys.stderr)
        return 3
    # TF32 stays off for matmuls, as in the tests (bf16 runs are unaffected)
    torch.backends.cuda.matmul.allow_tf32 = False
    results = Results(args.out)
    results.data.setdefault("environment", environment())
    if args.phase == "micro":
        cb = results.section("copy_bandwidth", copy_bandwidth)
        results.section("decode_attention", decode_attention, cb.get("gb_per_s"))
    elif args.phase == "model":
        results.section("model_build", build_llama_1b, args.model_dir)
    elif args.phase == "e2e":
        results.section("e2e_decode", e2e, results, args.model_dir, args.batch, args.prompt_len, args.output_len)
    elif args.phase == "graphs":
        results.section("cuda_graphs", graphs, results, args.model_dir)
    failed = [k for k, v in results.data.items() if isinstance(v, dict) and "error" in v]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
