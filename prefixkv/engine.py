"""``LLMEngine`` (add_request / step / abort) and the offline ``LLM`` API."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import random
from array import array
from typing import Any, Sequence

import torch

from prefixkv.attention import get_backend
from prefixkv.config import CacheConfig, EngineConfig, RuntimeInfo, SchedulerConfig
from prefixkv.errors import EngineFatalError
from prefixkv.model.loader import DTYPES, load_hf_config, load_model, resolve_dtype, resolve_model
from prefixkv.output_processor import OutputProcessor, RequestState
from prefixkv.outputs import CompletionOutput, RequestOutput
from prefixkv.request import Request, RequestStatus
from prefixkv.runner.memory import kv_cache_bytes_for, profile_activation_peak
from prefixkv.runner.model_runner import ModelRunner
from prefixkv.sampling_params import SamplingParams, generation_config_defaults
from prefixkv.scheduler import Scheduler
from prefixkv.structured_outputs import GrammarCompiler
from prefixkv.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

PromptType = str | Sequence[int]


def is_fatal(e: BaseException) -> bool:
    """Errors after which the device (or the process) cannot be trusted with another step."""
    if isinstance(e, MemoryError) or type(e).__name__ in ("AcceleratorError", "OutOfMemoryError"):
        return True
    msg = str(e)
    return "CUDA error" in msg or "device-side assert" in msg or "CUBLAS_STATUS" in msg


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device: 'cuda' requested but torch sees no CUDA device")
        if config.dtype == "float64" and config.device != "cpu":
            raise ValueError("dtype: float64 is supported on cpu only")
        self.model_path = resolve_model(config.model)
        self.tokenizer = Tokenizer.from_pretrained(str(self.model_path))
        self.dtype = resolve_dtype(config.dtype, config.device, load_hf_config(self.model_path))
        dtype = DTYPES[self.dtype]
        self.model, self.hf_config = load_model(self.model_path, self.dtype, config.device,
                                                cpu_linear=config.cpu_linear, cpu_ops=config.fused_cpu_ops)
        shape = self.model.shape
        max_len = config.max_model_len or shape.max_position_embeddings
        if shape.longrope_short_max is not None and max_len > shape.longrope_short_max:
            # past its original length transformers' LongRoPE switches every position to the long
            # factors (recomputing the cache): outputs that a paged cache cannot reproduce yet
            if config.max_model_len is not None:
                raise ValueError(f"max_model_len: {shape.model_type}'s LongRoPE is served up to its original "
                                 f"{shape.longrope_short_max} tokens (the short factors); got {config.max_model_len}")
            logger.warning("max_model_len: %s's LongRoPE is served up to its original %d tokens (the short "
                           "factors), not %d", shape.model_type, shape.longrope_short_max, max_len)
            max_len = shape.longrope_short_max
        bs = config.cache.block_size
        self.kv_plan = self._plan_kv_groups(shape)
        # a page holds one block of the layers of one group (every layer, without groups);
        # num_kv_blocks counts whole-model blocks: the same memory in pages
        lpg = self.kv_plan.layers_per_page
        num_blocks = (config.cache.num_kv_blocks * shape.num_layers // lpg if config.cache.num_kv_blocks else max(
            1, self._kv_cache_bytes() // ModelRunner.bytes_per_block(self.model, bs, dtype, lpg)))
        self.info = RuntimeInfo(num_kv_blocks=num_blocks, max_model_len=max_len,
                                eos_token_ids=list(self.tokenizer.eos_token_ids), vocab_size=shape.vocab_size)
        backend = get_backend(config.attention_backend or ("cpu" if config.device == "cpu" else "cuda"))
        self.batch_invariant = False
        if config.batch_invariant is not False:
            why = self._batch_invariance_blocker(backend)
            if why is not None and config.batch_invariant:
                raise ValueError(f"batch_invariant: {why}")
            backend.batch_invariant = self.batch_invariant = why is None
        self.runner = ModelRunner(self.model, backend, num_blocks, bs, config.device, dtype, self.info.eos_token_ids,
                                  max_len, self.kv_plan, config.cache, self.model_path)
        tiers = self.runner.tiers
        self.scheduler = Scheduler(config.scheduler.for_device(config.device), config.cache, num_blocks, max_len,
                                   tiers.num_host_pages, tiers.num_disk_pages, self.kv_plan.windows)
        self.scheduler.tiers.bind(tiers)
        self.graph_capture_seconds = 0.0
        if config.device == "cuda" and not config.enforce_eager and backend.name == "cuda":
            if shape.is_moe:  # the torch MoE path picks each step's experts on the host: no graph holds it
                logger.warning("model: %s's sparse MoE layers route on the host; decode runs eagerly (no CUDA "
                               "graphs)", shape.model_type)
            elif self.kv_plan.num_groups > 1:  # the graphs hold one block table
                logger.warning("model: %s's KV cache groups (sliding-window layers) decode eagerly (no CUDA graphs)",
                               shape.model_type)
            else:
                self.graph_capture_seconds = self.runner.capture_cuda_graphs(config.scheduler.max_num_seqs, max_len)
        self._rng = random.Random(config.seed)
        self._arrivals = itertools.count()
        self._groups: dict[str, RequestState] = {}
        self.output = OutputProcessor(self.tokenizer, self.info.eos_token_ids, max_len)
        self.grammars = GrammarCompiler(self.tokenizer, shape.vocab_size)
        gc_dir = {"auto": str(self.model_path) if self.model_path.is_dir() else None, "vllm": None}.get(
            config.generation_config, config.generation_config)
        # SamplingParams fields -> the model's defaults, for what a request leaves unset (server, LLM)
        self.default_sampling: dict[str, Any] = generation_config_defaults(gc_dir)
        self.check_integrity_each_step = False
        self.num_steps = 0
        self.num_aborted = 0  # requests aborted before they finished (client gone, timeout, shutdown)
        self.dead: BaseException | None = None  # set by a fatal step error (EngineFatalError)

    def _plan_kv_groups(self, shape):
        """KV cache groups for this model (kv/groups.py): by attention type when some layers are
        windowed, unless disabled."""
        from prefixkv.kv.groups import plan_kv_groups

        windows = shape.layer_windows or (None,) * shape.num_layers
        plan = plan_kv_groups(windows, not self.config.cache.disable_hybrid_kv_cache_manager)
        if plan.hybrid:
            logger.info("kv cache: %d groups of %d layers (windows %s); out-of-window blocks are freed",
                        plan.num_groups, plan.layers_per_page, list(plan.windows))
        return plan

    def flush_kv_cache(self) -> int:
        """Write every cached page the lowest tier lacks (on the device and in the host tier) to it,
        so that a restart finds them (a clean shutdown calls this). Returns how many."""
        plan = self.scheduler.tiers.flush(self.scheduler.kv.cached_pages())
        self.runner.tiers.execute(plan)
        self.runner.tiers.flush()
        return len(plan.persists) + len(plan.spills)

    def _batch_invariance_blocker(self, backend) -> str | None:
        """Why this engine cannot be batch-invariant, or None. The mode needs every op of the
        forward pass to compute a row the same way whatever the other rows: on CPU in float32 the
        C GEMM (rows bitwise independent of M), the fused C elementwise kernels and the C
        attention backend with one routine per query token (attention/cpu.py)."""
        from prefixkv.model.linear import Linear

        cfg = self.config
        if cfg.device != "cpu" or self.dtype != "float32":
            return f"is implemented for device 'cpu' in float32 (got {cfg.device!r}, {self.dtype})"
        if backend.name != "cpu":
            return f"needs attention_backend 'cpu' (got {backend.name!r})"
        if any(m.kind != "c" for m in self.model.modules() if isinstance(m, Linear)):
            return "needs cpu_linear 'c' (the C GEMM: oneDNN's and MKL's rows depend on the batch size)"
        if not (cfg.fused_cpu_ops and self.model.model.norm.fused):
            return "needs fused_cpu_ops (the C RMSNorm, RoPE and SiLU kernels)"
        s = self.model.shape
        return backend.batch_invariance_blocker(s.num_heads, cfg.cache.block_size, s.head_dim, DTYPES[self.dtype])

    def _kv_cache_bytes(self) -> int:
        cfg = self.config
        if cfg.cache.kv_cache_memory_bytes is not None:
            return cfg.cache.kv_cache_memory_bytes
        if cfg.device != "cuda":
            return 1 << 30
        peak = profile_activation_peak(self.model, cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_num_seqs)
        free, total = torch.cuda.mem_get_info()
        return kv_cache_bytes_for(total, free, cfg.gpu_memory_utilization, peak)

    # ------------------------------------------------------------------ requests
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            return prompt, self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt: must not be empty")
        v = self.info.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < v for t in ids):
            raise ValueError(f"prompt: token ids must be ints in [0, {v})")
        return None, ids

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None) -> None:
        """Validate and queue a request; raises ValueError naming the bad field (nothing changes)."""
        params = params or SamplingParams(**self.default_sampling)
        text, ids = self.prepare_request(prompt, params)
        self.enqueue(request_id, text, ids, params)

    def prepare_request(self, prompt: PromptType, params: SamplingParams) -> tuple[str | None, list[int]]:
        """Everything ``add_request`` checks that does not depend on the queue: the parameters, the
        prompt (tokenized here) and whether it fits the context and the cache. Returns (text, ids)."""
        params.validate(self.info.vocab_size)
        if params.structured_outputs is not None:  # compiled and validated here, cached for enqueue
            self.grammars.compile(params.structured_outputs)
        if params.bad_words:
            params.tokenize_bad_words(lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        if params.n > self.config.scheduler.max_num_seqs:
            raise ValueError(f"n: {params.n} samples exceed max_num_seqs ({self.config.scheduler.max_num_seqs})")
        text, ids = self.tokenize_prompt(prompt)
        max_len = self.info.max_model_len
        if len(ids) >= max_len:
            raise ValueError(f"prompt: {len(ids)} tokens leave no room to generate within the model's "
                             f"context of {max_len} tokens")
        need_blocks = self.kv_plan.pages_for(len(ids) + 1, self.config.cache.block_size,
                                             self.config.scheduler.max_num_batched_tokens)
        if need_blocks > self.info.num_kv_blocks:
            raise ValueError(f"prompt: {len(ids)} tokens need {need_blocks} KV blocks but the cache has only "
                             f"{self.info.num_kv_blocks}")
        return text, ids

    def enqueue(self, request_id: str, text: str | None, ids: list[int], params: SamplingParams) -> None:
        """Queue a request that ``prepare_request`` accepted."""
        if request_id in self._groups:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if self.scheduler.num_waiting >= self.config.scheduler.max_waiting_requests:
            raise OverflowError(f"the waiting queue is full ({self.scheduler.num_waiting} requests)")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        req = Request(request_id, ids, params, next(self._arrivals), seed)
        if params.structured_outputs is not None:
            req.matcher = self.grammars.matcher(params.structured_outputs)
        group = RequestState(request_id, text, array("q", ids), params)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = []
        group.seqs[0] = req
        self.scheduler.add_request(req)
        self._groups[request_id] = group

    def abort(self, request_id: str) -> bool:
        """Abort a request; its KV blocks are freed at once. False if it is unknown or done."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return False
        self._release(group, RequestStatus.FINISHED_ABORTED)
        self.num_aborted += 1
        return True

    def _release(self, group: RequestState, status: RequestStatus) -> None:
        """Finish every live sequence of a request: those the scheduler knows by id (n > 1 children
        a failed step forked but never handed over included), not only the group's."""
        seqs = {id(q): q for q in group.seqs.values()}
        for k in range(group.params.n):
            q = self.scheduler.requests.get(f"{group.request_id}#{k}")
            if q is not None:
                seqs[id(q)] = q
        for q in seqs.values():
            self.scheduler.finish_request(q, status)

    def _fail(self, group: RequestState, error: BaseException) -> RequestOutput:
        """A step failed for this request: free it and give its consumer the error (a finished
        output, ``finish_reason`` "error" for every sample, ``error`` saying what happened)."""
        self._groups.pop(group.request_id, None)
        self._release(group, RequestStatus.FINISHED_ABORTED)
        outs = [CompletionOutput(index=k, token_ids=[], text="", finish_reason="error") for k in range(group.params.n)]
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outs, True,
                             error=f"{type(error).__name__}: {error}")

    def has_unfinished(self) -> bool:
        return bool(self._groups)

    @property
    def num_unfinished(self) -> int:
        return len(self._groups)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """One scheduler step and one forward pass. Returns a RequestOutput for every request that
        produced something (deltas for streaming; ``finished`` when done). A request the step failed
        for gets a finished output with ``error`` set, its blocks freed; the others go on."""
        if self.dead is not None:
            raise EngineFatalError(f"the engine is dead after {type(self.dead).__name__}: {self.dead}")
        out = self.scheduler.schedule()
        touched: dict[str, RequestState] = {}
        for seq in out.out_of_memory:  # already finished by the scheduler
            group = self._groups.get(seq.request_id)
            if group is not None:
                self._finish(group, seq, RequestStatus.FINISHED_LENGTH, None)
                touched[group.request_id] = group
        if out.is_empty:
            if self.scheduler.waiting:
                self.scheduler.tiers.wait_for_reads(0.05)  # waiting only for lower tiers' reads: no busy loop
            return self._emit(touched)
        self.num_steps += 1
        try:
            model_out = self.runner.execute(out)
        except Exception as e:
            return self._failed_forward(out, e) + self._emit(touched)
        except BaseException:  # KeyboardInterrupt and the like: nothing of this step can be trusted
            for rid in list(self._groups):
                self.abort(rid)
            self.scheduler.reset_cache()
            raise
        failed: dict[str, tuple[RequestState, BaseException]] = {}
        update_errors: list[tuple[Request, BaseException]] = []
        changed = self.scheduler.update(out, model_out.sampled, update_errors)
        for seq, e in update_errors:
            group = self._groups.get(seq.request_id)
            if group is not None:
                failed.setdefault(group.request_id, (group, e))
        for s, plps in zip(out.scheduled, model_out.prompt_logprobs or ()):
            group = self._groups.get(s.req.request_id)
            if plps and group is not None and group.request_id not in failed:
                self.output.record_prompt_logprobs(group, plps)
        if any(model_out.logprobs):
            for s, lps in zip(out.scheduled, model_out.logprobs):
                if lps and s.req.request_id not in failed:
                    self._record_logprobs(s.req, lps, verified=bool(s.draft))
        for seq in changed:
            group = self._groups.get(seq.request_id)
            if group is None or group.request_id in failed:
                continue
            try:
                group.seqs[seq.sample_index] = seq
                finish = self.output.process_tokens(group, seq)
                if finish is not None:
                    self._finish(group, seq, *finish)
            except Exception as e:  # this request's output processing failed: it alone ends
                failed[group.request_id] = (group, e)
                continue
            touched[group.request_id] = group
        errors = [self._fail(group, e) for group, e in failed.values()]
        for rid in failed:
            touched.pop(rid, None)
        if self.check_integrity_each_step:
            self.scheduler.check_integrity()
        return errors + self._emit(touched)

    def _failed_forward(self, out, error: Exception) -> list[RequestOutput]:
        """The forward pass (or sampling, or a copy) raised. The step's scheduled requests (and those
        put off to the next step, whose blocks this step copied in) end with the error:
        their blocks entered the prefix cache when scheduled and copy-on-write already swapped
        tables, so no KV of this step can be trusted; with them go every unlocked cached block (so
        no later request reads KV that was never written). The others go on. A fatal error
        (``is_fatal``) aborts everything and raises ``EngineFatalError``."""
        fatal = is_fatal(error)
        hit = list(self._groups) if fatal else list(dict.fromkeys(
            [s.req.request_id for s in out.scheduled] + [r.request_id for r in out.tiers.deferred]))
        outputs = [self._fail(self._groups[rid], error) for rid in hit if rid in self._groups]
        self.scheduler.reset_cache(out)
        if fatal:
            self.dead = error
            raise EngineFatalError(f"the engine cannot continue after {type(error).__name__}: {error}") from error
        return outputs

    def _emit(self, touched: dict[str, RequestState]) -> list[RequestOutput]:
        outputs = [self.output.make_output(g) for g in touched.values()
                   if g.finished or g.params.output_kind != "final_only"]
        for g in touched.values():
            if g.finished:
                del self._groups[g.request_id]
        return outputs

    def _record_logprobs(self, req: Request, lps, verified: bool = False) -> None:
        """One entry per sample (a fork step: the n children), or with ``verified`` one per token
        ``req`` kept from its draft (the output processor drops those after a stop)."""
        group = self._groups.get(req.request_id)
        if group is None:
            return
        if verified:
            req.logprobs.extend(lps)
            return
        seq_ids = [req.seq_id] if len(lps) == 1 else [f"{req.request_id}#{k}" for k in range(len(lps))]
        for seq_id, entry in zip(seq_ids, lps):
            seq = self.scheduler.requests.get(seq_id)
            if seq is not None:
                seq.logprobs.append(entry)

    def _finish(self, group: RequestState, seq: Request, status: RequestStatus, reason: int | str | None) -> None:
        self.output.finish(group, seq, status, reason)
        self.scheduler.finish_request(seq, status)  # a no-op if the scheduler finished it

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def stats(self) -> dict[str, Any]:
        kv = self.scheduler.kv
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "num_kv_blocks": kv.num_blocks,
            "num_kv_blocks_used": kv.num_used_blocks,
            "num_kv_blocks_evictable": kv.pool.num_evictable,
            "prefix_queried_tokens": kv.num_queried_tokens,
            "prefix_hit_tokens": kv.num_hit_tokens,
            "prefix_host_hit_tokens": kv.num_lower_hit_tokens,
            **self.scheduler.tiers.stats(),
            **self.runner.tiers.stats(),
            "deferred_promotions": self.scheduler.num_deferred_promotions,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_requests_aborted": self.num_aborted,
            "spec_draft_tokens": self.scheduler.num_draft_tokens,
            "spec_accepted_tokens": self.scheduler.num_accepted_tokens,
        }

    def cache_summary(self, max_nodes: int = 64, text_tokens: int = 0) -> dict[str, Any]:
        """What the KV cache holds now, bounded in size: ``stats()``, the block size and the top of
        the radix tree (``RadixIndex.summary``). With ``text_tokens`` > 0 each shown node also
        carries ``text``, its first ``text_tokens`` tokens decoded (prompt text: the server shows
        it only when started with ``--cache-view-text``)."""
        tree = self.scheduler.kv.summary(max_nodes=max_nodes, max_tokens=text_tokens)
        if text_tokens > 0:
            stack = list(tree["root"]["children"])
            while stack:
                node = stack.pop()
                node["text"] = self.tokenizer.decode(node.pop("token_ids"), skip_special_tokens=False)
                stack.extend(node["children"])
        return {"stats": self.stats(), "block_size": self.scheduler.kv.block_size, "tree": tree}


class LLM:
    """Offline batch inference, as users know it from vLLM::

        llm = LLM(model=None, device="cpu", dtype="float32")
        outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))
    """

    def __init__(
        self,
        model: str | None = None,
        device: str = "cpu",
        dtype: str = "auto",
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        num_kv_blocks: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        disable_hybrid_kv_cache_manager: bool = False,
        kv_host_cache_gb: float = 0.0,
        kv_disk_cache_dir: str | None = None,
        kv_disk_cache_gb: float = 0.0,
        gpu_memory_utilization: float = 0.9,
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        seed: int = 0,
        attention_backend: str | None = None,
        enforce_eager: bool = False,
        cpu_linear: str = "auto",
        fused_cpu_ops: bool = True,
        batch_invariant: bool | None = None,
        scheduling_policy: str = "continuous",
        enable_chunked_prefill: bool = True,
        max_waiting_requests: int | None = None,
        num_speculative_tokens: int = 0,
        prompt_lookup_min: int = 1,
        prompt_lookup_max: int = 3,
        speculative_disable_by_batch_size: int | None = None,
        generation_config: str = "auto",
        max_admitted_prefill_tokens: int | str | None = "auto",
    ) -> None:
        cfg = EngineConfig(
            model=model, device=device, dtype=dtype, max_model_len=max_model_len, seed=seed,
            generation_config=generation_config,
            enforce_eager=enforce_eager, attention_backend=attention_backend, cpu_linear=cpu_linear,
            fused_cpu_ops=fused_cpu_ops, batch_invariant=batch_invariant, gpu_memory_utilization=gpu_memory_utilization,
            cache=CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks,
                              kv_cache_memory_bytes=kv_cache_memory_bytes,
                              enable_prefix_caching=enable_prefix_caching,
                              disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager,
                              host_cache_bytes=int(kv_host_cache_gb * (1 << 30)),
                              disk_cache_dir=kv_disk_cache_dir, disk_cache_bytes=int(kv_disk_cache_gb * (1 << 30))),
            scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                      max_admitted_prefill_tokens=max_admitted_prefill_tokens,
                                      policy=scheduling_policy, enable_chunked_prefill=enable_chunked_prefill,
                                      **({} if max_waiting_requests is None
                                         else dict(max_waiting_requests=max_waiting_requests)),
                                      num_speculative_tokens=num_speculative_tokens,
                                      prompt_lookup_min=prompt_lookup_min, prompt_lookup_max=prompt_lookup_max,
                                      speculative_disable_by_batch_size=speculative_disable_by_batch_size),
        )
        self.engine = LLMEngine(cfg)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """A clean shutdown: with a disk tier, every cached block is written there first (the next
        ``LLM`` on the same directory finds them)."""
        self.engine.flush_kv_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (vLLM's method); what
        ``generate`` and ``chat`` use when given none."""
        return SamplingParams(**self.engine.default_sampling)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts: must not be empty")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        # validate (and tokenize) everything before queueing anything; only finished outputs are
        # collected, so no per-step outputs are built
        final = {id(sp): dataclasses.replace(sp, output_kind="final_only") for sp in params}
        prepared = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            try:
                text, ids = self.engine.prepare_request(p, final[id(sp)])
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None
            prepared.append((f"gen-{next(self._ids)}", text, ids, final[id(sp)]))
        return self._run(prepared, use_tqdm)

    def _run(self, prepared: list[tuple[str, str | None, list[int], SamplingParams]],
             use_tqdm: bool) -> list[RequestOutput]:
        """Feed the requests as the waiting queue has room (a queue of any length costs each step
        only what max_waiting_requests allows) and step until all have finished."""
        eng = self.engine
        limit = eng.config.scheduler.max_waiting_requests
        done: dict[str, RequestOutput] = {}
        pending = collections.deque(prepared)
        added: list[str] = []
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(prepared), desc="generate", unit="req")
        try:
            while len(done) < len(prepared):
                while pending and eng.scheduler.num_waiting < limit:
                    rid, text, ids, sp = pending.popleft()
                    eng.enqueue(rid, text, ids, sp)
                    added.append(rid)
                for out in eng.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in added:
                eng.abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[rid] for rid, _, _, _ in prepared]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of conversations."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages: must be a non-empty list")
        convs = [messages] if isinstance(messages[0], dict) else messages
        prompts = []
        for i, conv in enumerate(convs):
            try:
                prompts.append(self.tokenizer.apply_chat_template(conv, add_generation_prompt=True))
            except ValueError as e:
                raise ValueError(f"messages[{i}]: {e}") from None
        return self.generate(prompts, sampling_params, use_tqdm)
