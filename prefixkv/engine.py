"""``LLMEngine``: add_request / step / abort over the scheduler and the model runner (``LLM``, the
offline API, is in llm.py)."""

from __future__ import annotations

import itertools
import operator
import os
import random
import time
from array import array
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from prefixkv.config import EngineConfig, RuntimeInfo
from prefixkv.errors import EngineFatalError
from prefixkv.kv import TierConnector
from prefixkv.kv.events import KVEventLog
from prefixkv.kv.hashing import BlockHasher
from prefixkv.model.loader import resolve_model
from prefixkv.output_processor import OutputProcessor, RequestState
from prefixkv.outputs import CompletionOutput, RequestOutput
from prefixkv.progress import Task
from prefixkv.request import Request, RequestStatus, seq_id_of
from prefixkv.runner.model_runner import ModelRunner
from prefixkv.sampling_params import SamplingParams, generation_config_defaults
from prefixkv.scheduler import Scheduler
from prefixkv.structured_outputs import GrammarCompiler
from prefixkv.tokenizer import Tokenizer

PromptType = str | Sequence[int]


def is_fatal(e: BaseException) -> bool:
    """Errors after which the device (or the process) cannot be trusted with another step."""
    if isinstance(e, MemoryError) or type(e).__name__ in ("AcceleratorError", "OutOfMemoryError"):
        return True
    msg = str(e)
    return "CUDA error" in msg or "device-side assert" in msg or "CUBLAS_STATUS" in msg


_computed = operator.attrgetter("num_computed_tokens")


@dataclass
class StepCounters:
    """What the steps took (``LLMEngine.stats()``; the replicas' routing reads the first four,
    serve/load.py): prompt tokens computed and the seconds of the steps that computed some, steps of
    decodes only and their seconds; the sequences decoding in each kind of step, and the context the
    decode-only steps' sequences attended to."""

    num_prefill_tokens: int = 0
    prefill_s: float = 0.0
    num_decode_steps: int = 0
    decode_s: float = 0.0
    num_prefill_step_decodes: int = 0  # sequences decoding beside the prompt tokens of a prefill step
    num_decode_step_seqs: int = 0  # sequences of the decode-only steps
    # the tokens of context the decode-only steps' sequences attended to (K/V read), theirs included
    num_decode_step_context_tokens: int = 0

    def count(self, out, seconds: float) -> None:
        num_prefill = sum(s.num_scheduled_tokens for s in out.scheduled[out.num_decodes:])
        if num_prefill:
            self.num_prefill_tokens += num_prefill
            self.prefill_s += seconds
            self.num_prefill_step_decodes += out.num_decodes
        else:
            self.num_decode_steps += 1
            self.decode_s += seconds
            self.num_decode_step_seqs += len(out.scheduled)
            # (the step's tokens, num_batched_tokens, are the new tokens of these contexts)
            self.num_decode_step_context_tokens += sum(map(_computed, out.scheduled)) + out.num_batched_tokens

    def stats(self) -> dict[str, Any]:
        return {**asdict(self), "prefill_s": round(self.prefill_s, 6), "decode_s": round(self.decode_s, 6)}


class LLMEngine:
    """The parts wired together: the tokenizer, the model runner (which builds itself from the
    configuration), the scheduler over the runner's KV cache, the output processor."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_path = resolve_model(config.model)
        with Task("loading the tokenizer", announce=False):
            self.tokenizer = Tokenizer.from_pretrained(str(self.model_path))
        eos = list(self.tokenizer.eos_token_ids)
        self.runner = runner = ModelRunner(config, self.model_path, eos)
        self.info = RuntimeInfo(num_kv_blocks=runner.num_pages, max_model_len=runner.max_model_len,
                                eos_token_ids=eos, vocab_size=runner.vocab_size)
        # KV events (kv/events.py, kv_events.py): the cache's changes, published once a step
        self.kv_events: KVEventLog | None = None
        self.kv_event_publisher = None
        if config.kv_events.enable_kv_cache_events:
            from prefixkv.kv_events import create_publisher

            hasher = BlockHasher.create(config.cache.prefix_caching_hash_algo, os.environ.get("PYTHONHASHSEED"))
            self.kv_events = KVEventLog(hasher, config.cache.block_size)
            self.kv_event_publisher = create_publisher(config.kv_events, data_parallel_rank=0)
        self.scheduler = Scheduler(config.scheduler.for_device(config.device), config.cache, runner.num_pages,
                                   runner.max_model_len, runner.kv_plan.windows, TierConnector.bound_to(runner.tiers),
                                   events=self.kv_events)
        self.output = OutputProcessor(self.tokenizer, eos, runner.max_model_len, config.scheduler.stream_interval)
        self.grammars = GrammarCompiler(self.tokenizer, runner.vocab_size)
        # SamplingParams fields -> the model's defaults, for what a request leaves unset (server, LLM)
        self.default_sampling: dict[str, Any] = generation_config_defaults(
            {"auto": str(self.model_path) if self.model_path.is_dir() else None, "vllm": None}.get(
                config.generation_config, config.generation_config))
        self._rng = random.Random(config.seed)
        self._arrivals = itertools.count()
        self._parents: dict[str, RequestState] = {}  # request id -> the request and its n sequences
        self.check_integrity_each_step = False
        self.num_steps = 0
        self.step_counters = StepCounters()
        self.num_aborted = 0  # requests aborted before they finished (client gone, timeout, shutdown)
        self.dead: BaseException | None = None  # set by a fatal step error (EngineFatalError)

    def flush_kv_cache(self) -> int:
        """Write every cached page the lowest tier lacks (on the device and in the host tier) to it,
        so that a restart finds them (a clean shutdown calls this). Returns how many."""
        plan = self.scheduler.tiers.flush(self.scheduler.kv.cached_pages())
        self.runner.tiers.execute(plan)
        self.runner.tiers.flush()
        return len(plan.persists) + len(plan.spills)

    def shutdown(self, flush: bool = True) -> int:
        """A clean end: ``flush_kv_cache`` (unless ``flush`` is False: the cache is not trusted),
        then the last KV events published and their publisher closed. Returns the pages flushed."""
        try:
            return self.flush_kv_cache() if flush else 0
        finally:
            self.publish_kv_events()
            if self.kv_event_publisher is not None:
                self.kv_event_publisher.shutdown()

    def publish_kv_events(self) -> None:
        """The KV events since the last call, as one batch (the engine calls it after every step)."""
        if self.kv_events is not None:
            events = self.kv_events.take()
            if events:
                self.kv_event_publisher.publish(events)

    def kv_events_info(self) -> dict[str, Any] | None:
        """Where this engine publishes its KV events and how it hashes blocks, for a subscriber
        that matches prompts against them (serve/router.py): the bound addresses (a wildcard port
        resolved), the topic, ``--prefix-caching-hash-algo`` and its root (hex; None for builtin,
        whose root is 0). None when events are off."""
        pub = self.kv_event_publisher
        if self.kv_events is None or not hasattr(pub, "endpoint"):
            return None
        root = self.kv_events.hasher.root
        return {"endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint, "topic": self.config.kv_events.topic,
                "hash_algo": self.kv_events.hasher.algo, "hash_root": root.hex() if isinstance(root, bytes) else None}

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block, in every tier (files included), as vLLM's
        ``reset_prefix_cache``: only while no request holds a block (False, nothing changed,
        otherwise). KV events tell ``AllBlocksCleared``."""
        kv = self.scheduler.kv
        if self.has_unfinished() or kv.num_used_blocks:
            return False
        kv.reset_cache()
        self.runner.tiers.execute(self.scheduler.tiers.clear())
        if self.kv_events is not None:
            self.kv_events.cleared()
            self.publish_kv_events()
        return True

    def release_retention(self, handle: str) -> bool:
        """Let go of the retention requests asked for under ``handle``
        (``SamplingParams.kv_retention_handle``) before its TTL: its blocks stay cached, evicted
        by recency, unless another retention still covers them (kv/retention.py). False if
        ``handle`` holds none (a request still waiting has retained nothing yet)."""
        return self.scheduler.kv.release_retention(handle)

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
        need_blocks = self.runner.kv_plan.pages_for(len(ids) + 1, self.config.cache.block_size,
                                                    self.config.scheduler.max_num_batched_tokens)
        if need_blocks > self.info.num_kv_blocks:
            raise ValueError(f"prompt: {len(ids)} tokens need {need_blocks} KV blocks but the cache has only "
                             f"{self.info.num_kv_blocks}")
        return text, ids

    def enqueue(self, request_id: str, text: str | None, ids: list[int], params: SamplingParams) -> None:
        """Queue a request that ``prepare_request`` accepted."""
        if request_id in self._parents:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if self.scheduler.num_waiting >= self.config.scheduler.max_waiting_requests:
            raise OverflowError(f"the waiting queue is full ({self.scheduler.num_waiting} requests)")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        req = Request(request_id, ids, params, next(self._arrivals), seed)
        if params.structured_outputs is not None:
            req.matcher = self.grammars.matcher(params.structured_outputs)
        parent = RequestState(request_id, text, array("q", ids), params)
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = []
        parent.seqs[0] = req
        self.scheduler.add_request(req)
        self._parents[request_id] = parent

    def abort(self, request_id: str) -> bool:
        """Abort a request; its KV blocks are freed at once. False if it is unknown or done."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return False
        self._release(parent, RequestStatus.FINISHED_ABORTED)
        self.num_aborted += 1
        return True

    def _release(self, parent: RequestState, status: RequestStatus) -> None:
        """Finish every live sequence of a request: those the scheduler knows by id (n > 1 children
        a failed step forked but never handed over included), not only those it holds."""
        seqs = {id(q): q for q in parent.seqs.values()}
        for k in range(parent.params.n):
            q = self.scheduler.requests.get(seq_id_of(parent.request_id, k))
            if q is not None:
                seqs[id(q)] = q
        for q in seqs.values():
            self.scheduler.finish_request(q, status)

    def _fail(self, parent: RequestState, error: BaseException) -> RequestOutput:
        """A step failed for this request: free it and give its consumer the error (a finished
        output, ``finish_reason`` "error" for every sample, ``error`` saying what happened)."""
        self._parents.pop(parent.request_id, None)
        self._release(parent, RequestStatus.FINISHED_ABORTED)
        outs = [CompletionOutput(index=k, token_ids=[], text="", finish_reason="error")
                for k in range(parent.params.n)]
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outs, True,
                             error=f"{type(error).__name__}: {error}")

    def has_unfinished(self) -> bool:
        return bool(self._parents)

    @property
    def num_unfinished(self) -> int:
        return len(self._parents)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """One scheduler step and one forward pass. Returns a RequestOutput for every request that
        produced something (deltas for streaming; ``finished`` when done). A request the step failed
        for gets a finished output with ``error`` set, its blocks freed; the others go on. The
        step's KV events are published as one batch."""
        if self.kv_events is None:
            return self._step()
        try:
            return self._step()
        finally:
            self.publish_kv_events()

    def _step(self) -> list[RequestOutput]:
        if self.dead is not None:
            raise EngineFatalError(f"the engine is dead after {type(self.dead).__name__}: {self.dead}")
        out = self.scheduler.schedule()
        touched: dict[str, RequestState] = {}
        for seq in out.out_of_memory:  # already finished by the scheduler
            parent = self._parents.get(seq.request_id)
            if parent is not None:
                self._finish(parent, seq, RequestStatus.FINISHED_LENGTH, None)
                touched[parent.request_id] = parent
        if out.is_empty:
            if self.scheduler.waiting:
                self.scheduler.tiers.wait_for_reads(0.05)  # waiting only for lower tiers' reads: no busy loop
            return self._emit(touched)
        self.num_steps += 1
        t0 = time.perf_counter()
        try:
            model_out = self.runner.execute(out)
        except Exception as e:
            return self._failed_forward(out, e) + self._emit(touched)
        except BaseException:  # KeyboardInterrupt and the like: nothing of this step can be trusted
            for rid in list(self._parents):
                self.abort(rid)
            self.scheduler.reset_cache()
            raise
        if out.scheduled:  # (not a step of copies only)
            self.step_counters.count(out, time.perf_counter() - t0)
        failed: dict[str, tuple[RequestState, BaseException]] = {}
        update_errors: list[tuple[Request, BaseException]] = []
        changed = self.scheduler.update(out, model_out.sampled, update_errors)
        for seq, e in update_errors:
            parent = self._parents.get(seq.request_id)
            if parent is not None:
                failed.setdefault(parent.request_id, (parent, e))
        for s, plps in zip(out.scheduled, model_out.prompt_logprobs or ()):
            parent = self._parents.get(s.req.request_id)
            if plps and parent is not None and parent.request_id not in failed:
                self.output.record_prompt_logprobs(parent, plps)
        if any(model_out.logprobs):
            for s, lps in zip(out.scheduled, model_out.logprobs):
                if lps and s.req.request_id not in failed:
                    self._record_logprobs(s.req, lps, verified=bool(s.draft))
        for seq in changed:
            parent = self._parents.get(seq.request_id)
            if parent is None or parent.request_id in failed:
                continue
            try:
                parent.seqs[seq.sample_index] = seq
                finish = self.output.process_tokens(parent, seq)
                if finish is not None:
                    self._finish(parent, seq, *finish)
            except Exception as e:  # this request's output processing failed: it alone ends
                failed[parent.request_id] = (parent, e)
                continue
            touched[parent.request_id] = parent
        errors = [self._fail(parent, e) for parent, e in failed.values()]
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
        hit = list(self._parents) if fatal else list(dict.fromkeys(
            [s.req.request_id for s in out.scheduled] + [r.request_id for r in out.tiers.deferred]))
        outputs = [self._fail(self._parents[rid], error) for rid in hit if rid in self._parents]
        self.scheduler.reset_cache(out)
        if fatal:
            self.dead = error
            raise EngineFatalError(f"the engine cannot continue after {type(error).__name__}: {error}") from error
        return outputs

    def _emit(self, touched: dict[str, RequestState]) -> list[RequestOutput]:
        due = self.output.due
        outputs = [self.output.make_output(p) for p in touched.values()
                   if p.finished or (p.params.output_kind != "final_only" and due(p))]
        for p in touched.values():
            if p.finished:
                del self._parents[p.request_id]
        return outputs

    def _record_logprobs(self, req: Request, lps, verified: bool = False) -> None:
        """One entry per sample (a fork step: the n children), or with ``verified`` one per token
        ``req`` kept from its draft (the output processor drops those after a stop)."""
        parent = self._parents.get(req.request_id)
        if parent is None:
            return
        if verified:
            req.logprobs.extend(lps)
            return
        seq_ids = [req.seq_id] if len(lps) == 1 else [seq_id_of(req.request_id, k) for k in range(len(lps))]
        for seq_id, entry in zip(seq_ids, lps):
            seq = self.scheduler.requests.get(seq_id)
            if seq is not None:
                seq.logprobs.append(entry)

    def _finish(self, parent: RequestState, seq: Request, status: RequestStatus, reason: int | str | None) -> None:
        self.output.finish(parent, seq, status, reason)
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
            **kv.retention_stats(),
            **self.scheduler.tiers.stats(),
            **self.runner.tiers.stats(),
            "deferred_promotions": self.scheduler.num_deferred_promotions,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_requests_aborted": self.num_aborted,
            "spec_draft_tokens": self.scheduler.num_draft_tokens,
            "spec_accepted_tokens": self.scheduler.num_accepted_tokens,
            **self.step_counters.stats(),
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


def __getattr__(name: str):
    if name == "LLM":  # (its own module now: llm.py; this name kept for ``from prefixkv.engine import LLM``)
        from prefixkv.llm import LLM

        return LLM
    raise AttributeError(f"module 'prefixkv.engine' has no attribute {name!r}")
