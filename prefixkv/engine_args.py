"""``EngineArgs``: every engine setting as one flat keyword, and the one way to an ``EngineConfig``.

``LLM(...)``, the command line (``prefixkv generate | serve``, through ``add_engine_args`` /
``engine_config_from_args``) and the benchmarks take these names (vLLM's ``EngineArgs``);
``create_engine_config`` nests and validates them (config.py). Below both the CLI and the server, so
neither imports the other.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from prefixkv.config import CacheConfig, EngineConfig, KVEventsConfig, SchedulerConfig

_GIB = 1 << 30


@dataclass
class EngineArgs:
    model: str | None = None  # a local HF model directory or .gguf file; None: the embedded SmolLM2-135M-Instruct
    device: str = EngineConfig.device
    dtype: str = EngineConfig.dtype
    max_model_len: int | None = None
    seed: int = EngineConfig.seed
    generation_config: str = EngineConfig.generation_config
    enforce_eager: bool = EngineConfig.enforce_eager
    attention_backend: str | None = None
    cpu_linear: str = EngineConfig.cpu_linear
    fused_cpu_ops: bool = EngineConfig.fused_cpu_ops
    batch_invariant: bool | None = None
    gpu_memory_utilization: float = EngineConfig.gpu_memory_utilization
    # the KV cache (CacheConfig)
    block_size: int = CacheConfig.block_size
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = CacheConfig.enable_prefix_caching
    disable_hybrid_kv_cache_manager: bool = CacheConfig.disable_hybrid_kv_cache_manager
    kv_host_cache_gb: float = 0.0
    kv_disk_cache_dir: str | None = None
    kv_disk_cache_gb: float = 0.0
    max_retained_fraction: float = CacheConfig.max_retained_fraction
    prefix_caching_hash_algo: str = CacheConfig.prefix_caching_hash_algo
    # KV cache events: a KVEventsConfig, its fields as a dict, or --kv-events-config's JSON; None: off
    kv_events_config: KVEventsConfig | dict | str | None = None
    # the scheduler (SchedulerConfig)
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    max_admitted_prefill_tokens: int | str | None = SchedulerConfig.max_admitted_prefill_tokens
    max_waiting_requests: int = SchedulerConfig.max_waiting_requests
    max_wait_steps: int = SchedulerConfig.max_wait_steps
    scheduling_policy: str = SchedulerConfig.policy
    enable_chunked_prefill: bool = SchedulerConfig.enable_chunked_prefill
    num_speculative_tokens: int = SchedulerConfig.num_speculative_tokens
    prompt_lookup_min: int = SchedulerConfig.prompt_lookup_min
    prompt_lookup_max: int = SchedulerConfig.prompt_lookup_max
    speculative_disable_by_batch_size: int | None = None
    stream_interval: int = SchedulerConfig.stream_interval

    @classmethod
    def names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The fields an ``add_engine_args`` parser filled in (the rest keep their defaults)."""
        given = vars(args)
        return cls(**{k: given[k] for k in cls.names() if k in given})

    def create_engine_config(self) -> EngineConfig:
        """The nested, validated configuration (a ``ValueError`` names a bad field)."""
        return EngineConfig(
            model=self.model, device=self.device, dtype=self.dtype, max_model_len=self.max_model_len, seed=self.seed,
            generation_config=self.generation_config, enforce_eager=self.enforce_eager,
            attention_backend=self.attention_backend, cpu_linear=self.cpu_linear, fused_cpu_ops=self.fused_cpu_ops,
            batch_invariant=self.batch_invariant, gpu_memory_utilization=self.gpu_memory_utilization,
            cache=CacheConfig(block_size=self.block_size, num_kv_blocks=self.num_kv_blocks,
                              kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                              enable_prefix_caching=self.enable_prefix_caching,
                              disable_hybrid_kv_cache_manager=self.disable_hybrid_kv_cache_manager,
                              host_cache_bytes=int(self.kv_host_cache_gb * _GIB),
                              disk_cache_dir=self.kv_disk_cache_dir,
                              disk_cache_bytes=int(self.kv_disk_cache_gb * _GIB),
                              max_retained_fraction=self.max_retained_fraction,
                              prefix_caching_hash_algo=self.prefix_caching_hash_algo),
            kv_events=kv_events_config(self.kv_events_config),
            scheduler=SchedulerConfig(max_num_batched_tokens=self.max_num_batched_tokens,
                                      max_num_seqs=self.max_num_seqs,
                                      max_admitted_prefill_tokens=self.max_admitted_prefill_tokens,
                                      max_waiting_requests=self.max_waiting_requests,
                                      max_wait_steps=self.max_wait_steps, policy=self.scheduling_policy,
                                      enable_chunked_prefill=self.enable_chunked_prefill,
                                      num_speculative_tokens=self.num_speculative_tokens,
                                      prompt_lookup_min=self.prompt_lookup_min, prompt_lookup_max=self.prompt_lookup_max,
                                      speculative_disable_by_batch_size=self.speculative_disable_by_batch_size,
                                      stream_interval=self.stream_interval),
        )


def kv_events_config(value: KVEventsConfig | dict | str | None) -> KVEventsConfig:
    """``kv_events_config`` as given (``--kv-events-config``'s JSON, a dict, a config or None: off)."""
    if value is None:
        return KVEventsConfig()
    if isinstance(value, KVEventsConfig):
        return value
    if isinstance(value, str):
        return KVEventsConfig.from_cli(value)
    if isinstance(value, dict):
        import json

        return KVEventsConfig.from_cli(json.dumps(value))
    raise ValueError(f"kv_events_config: must be a JSON object, a dict or a KVEventsConfig, got {value!r}")


def admitted_prefill_tokens(value: str) -> int | str | None:
    """--max-admitted-prefill-tokens: 'auto', 'none' or a number of tokens (checked by SchedulerConfig)."""
    if value in ("auto", "none"):
        return None if value == "none" else value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be auto, none or an int, got {value!r}") from None


def _gib_to_bytes(value: str) -> int:
    return int(float(value) * _GIB)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags; each one's destination is the ``EngineArgs`` field of the same meaning."""
    d = EngineArgs
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="local HF model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--device", default=d.device, choices=["cpu", "cuda"])
    g.add_argument("--dtype", default=d.dtype,
                   help="auto (float32 on cpu, the checkpoint's half dtype on cuda), float32, bfloat16, float16, float64")
    g.add_argument("--block-size", type=int, default=d.block_size)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-host-cache-gb", type=float, default=d.kv_host_cache_gb,
                   help="GiB of host memory for a KV tier under the device pool: evicted cached blocks are kept "
                        "there and copied back when a prompt matches them (default 0: none)")
    g.add_argument("--kv-disk-cache-dir", default=None,
                   help="a directory for a KV tier under the host tier; it survives restarts (needs --kv-host-cache-gb)")
    g.add_argument("--kv-disk-cache-gb", type=float, default=d.kv_disk_cache_gb, help="GiB the disk tier may fill")
    g.add_argument("--max-retained-fraction", type=float, default=d.max_retained_fraction,
                   help="at most this fraction of the KV cache's blocks can be retained by requests that ask "
                        "(kv_retention, Anthropic cache_control, stored Responses); past it the least recently "
                        f"used retentions lapse first (default {d.max_retained_fraction})")
    g.add_argument("--prefix-caching-hash-algo", default=d.prefix_caching_hash_algo,
                   help="the block hashes KV events publish: builtin (the cache's own), or vLLM's sha256_cbor / "
                        "sha256, their first parent from PYTHONHASHSEED (set it alike on the engine and the consumer)")
    g.add_argument("--kv-events-config", default=None,
                   help="KV cache events as vLLM's flag, a JSON object: e.g. '{\"enable_kv_cache_events\": true, "
                        "\"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}' (README: KV events)")
    g.add_argument("--kv-cache-memory", dest="kv_cache_memory_bytes", type=_gib_to_bytes, default=None,
                   help="GiB for the KV cache when --num-kv-blocks is unset (default: 1 on cpu; on cuda what "
                        "--gpu-memory-utilization leaves)")
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="cuda: fraction of device memory for weights, activations and the KV cache")
    g.add_argument("--attention-backend", default=None, choices=["cpu", "torch", "cuda"],
                   help="default: cpu (C kernels) on cpu, cuda (CuPy kernels) on cuda; torch: the plain torch path")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="keep every layer's KV for every block, also for sliding-window layers (which otherwise "
                        "free the blocks before their window)")
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument("--max-admitted-prefill-tokens", type=admitted_prefill_tokens, default=d.max_admitted_prefill_tokens,
                   help="once the requests a step admitted have this many prompt tokens scheduled, one whose "
                        "prefill would finish in the step waits for the next (one that only starts a chunked "
                        "prefill is still admitted): a burst of short prefills answered a few at a time. auto "
                        "(default): 16 on cpu, doubled for each step that held a request back until a step admits "
                        "the rest of the queue; none on cuda. none: the token budget alone")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-waiting-requests", type=int, default=d.max_waiting_requests,
                   help="requests queued beyond this are refused with 503")
    g.add_argument("--max-wait-steps", type=int, default=d.max_wait_steps,
                   help="waiting requests are admitted longest cached prefix first, except that one passed over "
                        "for this many steps goes ahead, oldest first; 0: admitted in arrival order "
                        "(default: %(default)s)")
    g.add_argument("--stream-interval", type=int, default=d.stream_interval,
                   help="a streamed request's output goes out every this many new tokens (its first token and "
                        "its finish at once); a request's stream_interval can raise it (default: %(default)s)")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--cpu-linear", default=d.cpu_linear, choices=["auto", "c", "onednn", "torch"],
                   help="CPU float32 GEMMs: the engine's C kernel on packed weights, oneDNN on prepacked "
                        "weights, or torch's F.linear (auto: c where built with AVX-512 or AVX2, else onednn)")
    g.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="every logit of a request bitwise the same whatever else is batched, cached, chunked, "
                        "preempted or speculated (cpu, float32; default: on wherever possible)")
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--generation-config", default=d.generation_config,
                   help="request defaults: auto (the model's generation_config.json), vllm (none), or a "
                        "directory holding a generation_config.json")
    g.add_argument("--num-speculative-tokens", type=int, default=d.num_speculative_tokens,
                   help="exact n-gram (prompt lookup) speculative decoding for greedy requests: draft tokens per "
                        "step, 0 = off")
    g.add_argument("--prompt-lookup-min", type=int, default=d.prompt_lookup_min,
                   help="shortest n-gram a draft is looked up by")
    g.add_argument("--prompt-lookup-max", type=int, default=d.prompt_lookup_max,
                   help="longest n-gram a draft is looked up by")
    g.add_argument("--speculative-disable-by-batch-size", type=int, default=None,
                   help="no drafts while this many requests are running or waiting")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineArgs.from_cli_args(args).create_engine_config()
