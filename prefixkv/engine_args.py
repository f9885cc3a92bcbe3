"""Engine flags shared by ``prefixkv generate`` and ``prefixkv serve``: argparse <-> EngineConfig
(below both the CLI and the server, so neither imports the other)."""

from __future__ import annotations

import argparse


def admitted_prefill_tokens(value: str) -> int | str | None:
    """--max-admitted-prefill-tokens: 'auto', 'none' or a number of tokens (checked by SchedulerConfig)."""
    if value in ("auto", "none"):
        return None if value == "none" else value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be auto, none or an int, got {value!r}") from None


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="local HF model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    g.add_argument("--dtype", default="auto",
                   help="auto (float32 on cpu, the checkpoint's half dtype on cuda), float32, bfloat16, float16, float64")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-host-cache-gb", type=float, default=0.0,
                   help="GiB of host memory for a KV tier under the device pool: evicted cached blocks are kept "
                        "there and copied back when a prompt matches them (default 0: none)")
    g.add_argument("--kv-disk-cache-dir", default=None,
                   help="a directory for a KV tier under the host tier; it survives restarts (needs --kv-host-cache-gb)")
    g.add_argument("--kv-disk-cache-gb", type=float, default=0.0, help="GiB the disk tier may fill")
    g.add_argument("--kv-cache-memory", type=float, default=None,
                   help="GiB for the KV cache when --num-kv-blocks is unset (default: 1 on cpu; on cuda what "
                        "--gpu-memory-utilization leaves)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="cuda: fraction of device memory for weights, activations and the KV cache")
    g.add_argument("--attention-backend", default=None, choices=["cpu", "torch", "cuda"],
                   help="default: cpu (C kernels) on cpu, cuda (CuPy kernels) on cuda; torch: the plain torch path")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="keep every layer's KV for every block, also for sliding-window layers (which otherwise "
                        "free the blocks before their window)")
    g.add_argument("--max-num-batched-tokens", type=int, default=512)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-admitted-prefill-tokens", type=admitted_prefill_tokens, default="auto",
                   help="once the requests a step admitted have this many prompt tokens scheduled, one whose "
                        "prefill would finish in the step waits for the next (one that only starts a chunked "
                        "prefill is still admitted): a burst of short prefills answered a few at a time. auto "
                        "(default): 16 on cpu, doubled for each step that held a request back until a step admits "
                        "the rest of the queue; none on cuda. none: the token budget alone")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-waiting-requests", type=int, default=None,
                   help="requests queued beyond this are refused with 503 (default: SchedulerConfig's)")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--cpu-linear", default="auto", choices=["auto", "c", "onednn", "torch"],
                   help="CPU float32 GEMMs: the engine's C kernel on packed weights, oneDNN on prepacked "
                        "weights, or torch's F.linear (auto: c where built with AVX-512 or AVX2, else onednn)")
    g.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="every logit of a request bitwise the same whatever else is batched, cached, chunked, "
                        "preempted or speculated (cpu, float32; default: on wherever possible)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--generation-config", default="auto",
                   help="request defaults: auto (the model's generation_config.json), vllm (none), or a "
                        "directory holding a generation_config.json")
    g.add_argument("--num-speculative-tokens", type=int, default=0,
                   help="exact n-gram (prompt lookup) speculative decoding for greedy requests: draft tokens per "
                        "step, 0 = off")
    g.add_argument("--prompt-lookup-min", type=int, default=1, help="shortest n-gram a draft is looked up by")
    g.add_argument("--prompt-lookup-max", type=int, default=3, help="longest n-gram a draft is looked up by")
    g.add_argument("--speculative-disable-by-batch-size", type=int, default=None,
                   help="no drafts while this many requests are running or waiting")


def engine_config_from_args(args: argparse.Namespace):
    from prefixkv.config import CacheConfig, EngineConfig, SchedulerConfig

    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed,
        enforce_eager=args.enforce_eager, cpu_linear=args.cpu_linear, attention_backend=args.attention_backend,
        batch_invariant=args.batch_invariant, generation_config=args.generation_config,
        gpu_memory_utilization=args.gpu_memory_utilization,
        cache=CacheConfig(block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                          kv_cache_memory_bytes=None if args.kv_cache_memory is None
                          else int(args.kv_cache_memory * (1 << 30)),
                          enable_prefix_caching=not args.no_prefix_caching,
                          disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
                          host_cache_bytes=int(args.kv_host_cache_gb * (1 << 30)),
                          disk_cache_dir=args.kv_disk_cache_dir,
                          disk_cache_bytes=int(args.kv_disk_cache_gb * (1 << 30))),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_num_seqs=args.max_num_seqs,
                                  max_admitted_prefill_tokens=args.max_admitted_prefill_tokens,
                                  **({} if args.max_waiting_requests is None
                                     else dict(max_waiting_requests=args.max_waiting_requests)),
                                  num_speculative_tokens=args.num_speculative_tokens,
                                  prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max,
                                  speculative_disable_by_batch_size=args.speculative_disable_by_batch_size),
    )
