"""Frozen engine configuration, validated on construction.

Values only known at run time (number of KV blocks, eos ids, the model's shape) live in
``RuntimeInfo``, kept apart from what the user asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from prefixkv.kv.hashing import HASH_ALGOS
from prefixkv.validation import require

SUPPORTED_DTYPES = ("auto", "float32", "float64", "float16", "bfloat16")
SUPPORTED_DEVICES = ("cpu", "cuda")
# max_admitted_prefill_tokens="auto": the cap it starts from, and returns to once a step's admission
# got through the queue (bench/RESULTS.md, 2026-12-05, `0c1184f`: 16 and 32 measured)
AUTO_ADMITTED_PREFILL_TOKENS = 16


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Explicit number of KV blocks; None derives it from kv_cache_memory_bytes, and that when None
    # is 1 GiB on CPU and, on CUDA, what EngineConfig.gpu_memory_utilization leaves free.
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    # the host-memory tier under the device pool (kv/host_cache.py): evicted cached blocks are kept
    # there, in at most this many bytes, and copied back when a prompt matches them; 0 = none
    host_cache_bytes: int = 0
    # the disk tier under the host tier (kv/disk_cache.py, runner/disk_store.py): blocks the host
    # tier lets go of are written to files in this directory, at most disk_cache_bytes of them, and
    # they survive restarts; needs the host tier
    disk_cache_dir: str | None = None
    disk_cache_bytes: int = 0
    # A model with sliding-window layers keeps its layers' KV in groups by attention type, and a
    # windowed group's blocks that fall wholly before its window go back to the pool as a request
    # advances (kv/groups.py); the host and disk tiers keep every group's pages alike. True keeps
    # every layer's KV for every block in one group (as for a model without windows), e.g. to compare.
    disable_hybrid_kv_cache_manager: bool = False
    # At most this fraction of the pool's blocks can be retained (requests' kv_retention,
    # kv/retention.py); past it the least recently used retentions lapse first.
    max_retained_fraction: float = 0.5
    # the block hashes KV events publish (kv/hashing.py): "builtin" (the chain every tier keys by),
    # or vLLM's "sha256_cbor" / "sha256" (their first parent from PYTHONHASHSEED, as vLLM), so a
    # consumer that hashes request tokens as vLLM does finds the blocks; the cache keys by "builtin"
    prefix_caching_hash_algo: str = "builtin"

    def __post_init__(self) -> None:
        require(isinstance(self.max_retained_fraction, (int, float)) and not isinstance(self.max_retained_fraction, bool)
                and 0.0 <= self.max_retained_fraction <= 1.0, "max_retained_fraction",
                f"must be a number in [0, 1], got {self.max_retained_fraction!r}")
        require(isinstance(self.block_size, int) and 1 <= self.block_size <= 1024,
                 "block_size", f"must be an int in [1, 1024], got {self.block_size!r}")
        if self.num_kv_blocks is not None:
            require(isinstance(self.num_kv_blocks, int) and self.num_kv_blocks >= 1,
                     "num_kv_blocks", f"must be a positive int, got {self.num_kv_blocks!r}")
        require(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0, "kv_cache_memory_bytes",
                 "must be positive")
        require(isinstance(self.host_cache_bytes, int) and self.host_cache_bytes >= 0, "kv_host_cache_gb",
                 f"must be >= 0, got {self.host_cache_bytes!r} bytes")
        require(isinstance(self.disk_cache_bytes, int) and self.disk_cache_bytes >= 0, "kv_disk_cache_gb",
                 f"must be >= 0, got {self.disk_cache_bytes!r} bytes")
        require(self.prefix_caching_hash_algo in HASH_ALGOS, "prefix_caching_hash_algo",
                f"must be one of {HASH_ALGOS}, got {self.prefix_caching_hash_algo!r}")
        if self.disk_cache_dir is not None:
            require(self.disk_cache_bytes > 0, "kv_disk_cache_gb", "must be > 0 with kv_disk_cache_dir")
            require(self.host_cache_bytes > 0, "kv_disk_cache_dir",
                    "the disk tier sits under the host tier: set kv_host_cache_gb too")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    # A step admits waiting requests until the prompt tokens it schedules for those it admitted
    # reach this (the first is admitted whatever its size, within the token budget): a burst of
    # short prefills (returning turns whose history is cached) is spread over several steps, the
    # first of them answered after a short step instead of all after one long one. An int: that
    # cap, every step. "auto": AUTO_ADMITTED_PREFILL_TOKENS, doubled for each step that held a
    # request back until a step admits the rest of the queue (a burst is admitted within a few
    # steps, not one request a step), on CPU; on CUDA the token budget alone (not measured on a
    # GPU). None: the token budget alone.
    max_admitted_prefill_tokens: int | str | None = "auto"
    max_waiting_requests: int = 4096
    # A waiting request that has been passed over for this many steps is admitted in arrival
    # order ahead of requests with longer cached prefixes (aging: nobody starves). 0: every
    # request is admitted in arrival order (no cache-aware reordering).
    max_wait_steps: int = 64
    # "continuous" admits new requests every step; "static" admits only once the running
    # batch has drained (the classic static-batching baseline, for ablations).
    policy: str = "continuous"
    enable_chunked_prefill: bool = True
    # Admission leaves this fraction of the KV blocks free (or evictable) while others run, so the
    # running requests' next decode blocks rarely force a preemption (recompute) right away.
    watermark: float = 0.01
    # Exact speculative decoding by n-gram prompt lookup (prefixkv/spec_decode.py): up to this many
    # draft tokens per greedy decode, verified in the same pass; 0 = off.
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    # No drafts while this many requests or more are running or waiting (None: always draft). A
    # draft makes a step compute more rows; that pays while weight streaming dominates (small
    # batches, GPUs), not once a large batch already keeps the matmuls busy.
    speculative_disable_by_batch_size: int | None = None
    # A streamed request's outputs go out every this many new tokens (first token and finish at
    # once); a request's SamplingParams.stream_interval can only raise it. 1: every step.
    stream_interval: int = 1

    def __post_init__(self) -> None:
        require(isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens >= 1,
                 "max_num_batched_tokens", f"must be a positive int, got {self.max_num_batched_tokens!r}")
        require(isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1,
                 "max_num_seqs", f"must be a positive int, got {self.max_num_seqs!r}")
        if self.max_admitted_prefill_tokens not in (None, "auto"):
            require(isinstance(self.max_admitted_prefill_tokens, int)
                     and not isinstance(self.max_admitted_prefill_tokens, bool)
                     and self.max_admitted_prefill_tokens >= 1, "max_admitted_prefill_tokens",
                     f"must be a positive int, 'auto' or None, got {self.max_admitted_prefill_tokens!r}")
            require(self.policy == "continuous", "max_admitted_prefill_tokens",
                     "applies to the continuous policy only (static admits a batch once)")
        require(self.max_waiting_requests >= 1, "max_waiting_requests", "must be >= 1")
        require(isinstance(self.stream_interval, int) and not isinstance(self.stream_interval, bool)
                and self.stream_interval >= 1, "stream_interval",
                f"must be a positive int, got {self.stream_interval!r}")
        require(isinstance(self.max_wait_steps, int) and not isinstance(self.max_wait_steps, bool)
                and self.max_wait_steps >= 0, "max_wait_steps", f"must be an int >= 0, got {self.max_wait_steps!r}")
        require(self.policy in ("continuous", "static"), "policy",
                 f"must be 'continuous' or 'static', got {self.policy!r}")
        require(isinstance(self.watermark, (int, float)) and 0.0 <= self.watermark < 1.0, "watermark",
                 f"must be a fraction in [0, 1), got {self.watermark!r}")
        require(isinstance(self.num_speculative_tokens, int) and 0 <= self.num_speculative_tokens <= 64,
                 "num_speculative_tokens", f"must be an int in [0, 64], got {self.num_speculative_tokens!r}")
        require(isinstance(self.prompt_lookup_min, int) and isinstance(self.prompt_lookup_max, int)
                 and 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 16, "prompt_lookup_min",
                 f"need 1 <= prompt_lookup_min <= prompt_lookup_max <= 16, got {self.prompt_lookup_min!r}, "
                 f"{self.prompt_lookup_max!r}")
        if self.speculative_disable_by_batch_size is not None:
            require(isinstance(self.speculative_disable_by_batch_size, int)
                     and self.speculative_disable_by_batch_size >= 1, "speculative_disable_by_batch_size",
                     f"must be a positive int or None, got {self.speculative_disable_by_batch_size!r}")

    def for_device(self, device: str) -> SchedulerConfig:
        """What a scheduler on ``device`` runs: ``max_admitted_prefill_tokens="auto"`` was measured on
        CPU, where a step's time grows with its tokens from a few on; a GPU step costs about the same
        up to hundreds of them (not measured yet), so there "auto" is no cap."""
        if device == "cuda" and self.max_admitted_prefill_tokens == "auto":
            return replace(self, max_admitted_prefill_tokens=None)
        return self


KV_EVENT_PUBLISHERS = ("null", "zmq")
ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KVEventsConfig:
    """KV cache events (``--kv-events-config``, vLLM's ``KVEventsConfig``: same fields, defaults and
    JSON): the cache's stored/removed blocks published on a ZMQ PUB socket (``kv_events.py``)."""

    enable_kv_cache_events: bool = False
    # "zmq" or "null"; None: "zmq" when events are enabled, else "null" (as vLLM)
    publisher: str | None = None
    # PUB socket: bound when it holds "*", "::", ipc:// or inproc://, else connected (as vLLM)
    endpoint: str = "tcp://*:5557"
    # ROUTER socket answering a starting sequence number with the batches since (None: no replay)
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # published batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark (0: ZMQ's unlimited)
    max_queue_size: int = 100_000  # batches waiting for the publishing thread; past it a batch is dropped
    topic: str = ""

    def __post_init__(self) -> None:
        require(isinstance(self.enable_kv_cache_events, bool), "kv_events_config.enable_kv_cache_events",
                f"must be a bool, got {self.enable_kv_cache_events!r}")
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        require(self.publisher in KV_EVENT_PUBLISHERS, "kv_events_config.publisher",
                f"must be one of {KV_EVENT_PUBLISHERS}, got {self.publisher!r}")
        endpoints = {"endpoint": self.endpoint}
        if self.replay_endpoint is not None:
            endpoints["replay_endpoint"] = self.replay_endpoint
        for name, value in endpoints.items():
            require(isinstance(value, str) and value.startswith(ZMQ_SCHEMES), f"kv_events_config.{name}",
                    f"must be a ZMQ address starting with one of {ZMQ_SCHEMES}, got {value!r}")
        for name, low in (("buffer_steps", 0), ("hwm", 0), ("max_queue_size", 1)):
            value = getattr(self, name)
            require(isinstance(value, int) and not isinstance(value, bool) and value >= low,
                    f"kv_events_config.{name}", f"must be an int >= {low}, got {value!r}")
        require(isinstance(self.topic, str), "kv_events_config.topic", f"must be a string, got {self.topic!r}")

    @classmethod
    def from_cli(cls, text: str) -> "KVEventsConfig":
        """``--kv-events-config``'s JSON object, e.g. ``'{"enable_kv_cache_events": true}'``."""
        import json
        from dataclasses import fields

        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"kv_events_config: not valid JSON ({e})") from None
        require(isinstance(obj, dict), "kv_events_config", f"must be a JSON object, got {text!r}")
        known = [f.name for f in fields(cls)]
        for name in obj:
            require(name in known, f"kv_events_config.{name}", f"unknown field (known: {known})")
        return cls(**obj)


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None = the embedded SmolLM2-135M-Instruct
    device: str = "cpu"
    dtype: str = "auto"  # float32 on CPU; on CUDA the checkpoint's half dtype (else bfloat16)
    max_model_len: int | None = None
    seed: int = 0
    enforce_eager: bool = False
    attention_backend: str | None = None  # None = "cpu" on cpu, "cuda" on cuda
    # CPU float32 GEMMs (model/linear.py): "c" (the engine's AVX-512 / AVX2 kernel on packed weights),
    # "onednn" (oneDNN on prepacked weights), "torch" (F.linear, MKL); "auto": c, else onednn
    cpu_linear: str = "auto"
    # CPU: RoPE, residual-add + RMSNorm and SiLU-and-mul through the C kernels (prefixkv/cpu_ops.py)
    fused_cpu_ops: bool = True
    # every logit of a request bitwise the same whatever the batch, cache, chunking, preemption or
    # speculation (CPU float32: the C GEMM, the C kernels, one attention routine per query token).
    # None: on wherever the engine can make it so (it costs <= 3%: bench/RESULTS.md); True: required
    batch_invariant: bool | None = None
    # CUDA, when CacheConfig.num_kv_blocks is unset: the KV cache takes this fraction of the device's
    # memory minus the weights and the profiled activation peak (as vLLM's --gpu-memory-utilization)
    gpu_memory_utilization: float = 0.9
    # request defaults: "auto" = the model's generation_config.json (temperature, top_p, top_k, min_p,
    # repetition_penalty, max_new_tokens) for the fields a request leaves unset, as vLLM's
    # --generation-config auto; "vllm" = SamplingParams' own defaults; or a directory holding one
    generation_config: str = "auto"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # KV cache events for routers (kv_events.py, ``--kv-events-config``): off by default
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)

    def __post_init__(self) -> None:
        require(isinstance(self.kv_events, KVEventsConfig), "kv_events_config",
                f"must be a KVEventsConfig, got {type(self.kv_events).__name__}")
        require(self.device in SUPPORTED_DEVICES, "device",
                 f"must be one of {SUPPORTED_DEVICES}, got {self.device!r}")
        require(self.dtype in SUPPORTED_DTYPES, "dtype",
                 f"must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        require(self.dtype != "float64" or self.device == "cpu", "dtype", "float64 is supported on cpu only")
        require(isinstance(self.gpu_memory_utilization, (int, float)) and 0.0 < self.gpu_memory_utilization <= 1.0,
                 "gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization!r}")
        require(self.batch_invariant is None or isinstance(self.batch_invariant, bool), "batch_invariant",
                 f"must be a bool or None, got {self.batch_invariant!r}")
        require(self.cpu_linear in ("auto", "c", "onednn", "torch"), "cpu_linear",
                 f"must be one of ('auto', 'c', 'onednn', 'torch'), got {self.cpu_linear!r}")
        if self.max_model_len is not None:
            require(isinstance(self.max_model_len, int) and self.max_model_len >= 1,
                     "max_model_len", f"must be a positive int, got {self.max_model_len!r}")




@dataclass
class RuntimeInfo:
    """Discovered at start-up: not configuration."""

    num_kv_blocks: int
    max_model_len: int
    eos_token_ids: list[int]
    vocab_size: int
