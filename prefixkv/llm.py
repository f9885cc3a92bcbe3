"""``LLM``: offline batch inference over an ``LLMEngine`` (vLLM's ``LLM``)."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from typing import Any, Sequence

from prefixkv.engine import LLMEngine, PromptType
from prefixkv.engine_args import EngineArgs
from prefixkv.outputs import RequestOutput
from prefixkv.progress import Task
from prefixkv.sampling_params import SamplingParams


class LLM:
    """Offline batch inference, as users know it from vLLM::

        llm = LLM(model=None, device="cpu", dtype="float32")
        outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """``kwargs``: any ``EngineArgs`` field (engine_args.py), e.g. ``device``, ``dtype``,
        ``block_size``, ``num_kv_blocks``, ``max_num_batched_tokens``, ``kv_host_cache_gb``."""
        unknown = sorted(set(kwargs) - EngineArgs.names())
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword arguments {unknown} (the EngineArgs fields are taken)")
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs).create_engine_config())
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """A clean shutdown: with a disk tier, every cached block is written there first (the next
        ``LLM`` on the same directory finds them), and the KV event publisher closed."""
        self.engine.shutdown()

    def reset_prefix_cache(self) -> bool:
        """``LLMEngine.reset_prefix_cache``: every cached block dropped, if no request holds one."""
        return self.engine.reset_prefix_cache()

    def release_retention(self, handle: str) -> bool:
        """``LLMEngine.release_retention``: the retention asked under ``handle`` lets go before its TTL."""
        return self.engine.release_retention(handle)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (vLLM's method); what
        ``generate`` and ``chat`` use when given none."""
        return SamplingParams(**self.engine.default_sampling)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Every prompt's finished output, in order. ``use_tqdm`` (as vLLM's): a progress bar of the
        finished requests on a terminal, a line every 10 s off one, from a batch's first second on
        (prefixkv/progress.py; ``PREFIXKV_QUIET=1`` silences it too)."""
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
        bar = Task("generate", total=len(prepared), unit="req", announce=False) if use_tqdm else None
        num_output_tokens, t0 = 0, time.perf_counter()
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
                            num_output_tokens += sum(len(c.token_ids) for c in out.outputs)
                            bar.update(1, f"{num_output_tokens / (time.perf_counter() - t0):.1f} output tok/s")
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
        use_tqdm: bool = True,
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
