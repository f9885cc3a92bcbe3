"""Continuous batching with chunked prefill under one token budget per step. No torch.

Each step:
1. Running requests, oldest first, get their remaining tokens (1 for a decode, a chunk for a
   prefill) within the budget. If blocks run out, the youngest running request is preempted
   (its blocks freed, it is requeued and later recomputed from its tokens: output unchanged).
2. Waiting requests are admitted while budget, ``max_num_seqs`` and blocks allow (keeping a
   ``watermark`` of free blocks while others run), in
   cache-aware order (longest cached prefix first), except that preempted requests and requests
   passed over for ``max_wait_steps`` steps go first, oldest first (aging). With
   ``max_admitted_prefill_tokens``, once those admitted in a step have that many prompt tokens
   scheduled, a request whose prefill would finish in the step waits for the next one (a burst
   of short prefills answered a few at a time, not all after one long step); with "auto" that
   cap doubles for each step in a row that held a request back (until a pass admits the rest of
   the queue), so a burst of B tokens is in after about log2(B / cap) steps more than the token
   budget alone takes.

Blocks that will be full once this step's tokens are computed enter the radix index when they are
scheduled, not after the forward pass: a request admitted later in the same step then shares them
(every layer writes the whole batch's K/V before it attends), so N requests arriving together
with one system prompt compute it once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prefixkv.config import AUTO_ADMITTED_PREFILL_TOKENS, CacheConfig, SchedulerConfig
from prefixkv.kv import CopyOp, KVCacheCoordinator, MatchResult, TableDelta, TierConnector, TierPlan
from prefixkv.kv.events import KVEventLog
from prefixkv.request import Request, RequestStatus
from prefixkv.spec_decode import NgramIndex

# How many waiting requests the cache-aware ordering looks at per step.
_ORDER_WINDOW = 128
_PREFETCH_AHEAD = 8  # waiting requests past those admitted whose lower-tier reads a pass starts


@dataclass(slots=True)
class ScheduledRequest:
    req: Request  # its sampling parameters and state, read by the sampler (the step's inputs are below)
    # query tokens this step: positions [num_computed_tokens, num_computed_tokens + num_scheduled_tokens)
    num_scheduled_tokens: int
    num_computed_tokens: int  # the request's num_computed_tokens when scheduled
    # Sample after this chunk (it reaches the end of the known tokens); num_samples > 1 only
    # for the step that completes the prompt of an n > 1 request (the n samples fork it).
    num_samples: int
    # Speculative draft tokens (decodes only): the query is [last token] + draft, every position
    # is verified, and num_scheduled_tokens == 1 + len(draft).
    draft: list[int] = field(default_factory=list)
    # Copied when the step is scheduled (later changes to the request do not reach them):
    token_ids: list[int] = field(default_factory=list)  # the query tokens
    # its block tables' change since the request was last scheduled, None if unchanged (the
    # runner keeps every live table)
    block_delta: TableDelta | None = None


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # decodes first, then prefill chunks
    num_decodes: int  # the first num_decodes entries are decodes (one token at the last position)
    copy_ops: list[CopyOp]
    preempted: list[Request]
    # finished ("length") because the whole KV cache cannot hold them
    out_of_memory: list[Request]
    num_batched_tokens: int
    # tables dropped since the last step (finished, aborted, preempted): the runner forgets them
    # before it applies this step's block_delta entries
    released_seq_ids: list[str] = field(default_factory=list)
    # the lower tiers' copies, before anything else of the step (kv/tiers.py); a step may carry
    # copies only: the loads of requests put off to the next step
    tiers: TierPlan = field(default_factory=TierPlan)

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.tiers.has_copies)


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
                 max_model_len: int | None = None, kv_windows: tuple[int | None, ...] = (None,),
                 tiers: TierConnector | None = None, events: KVEventLog | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.block_size = cache_config.block_size
        # the host and disk tiers' scheduler side (none by default), bound to the worker that runs its plans
        self.tiers = tiers or TierConnector()
        # kv_windows: per KV cache group (kv/groups.py) its sliding window or None; counts are in pages
        self.kv = KVCacheCoordinator(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
                                     kv_windows, lower=self.tiers, events=events,
                                     max_retained_fraction=cache_config.max_retained_fraction, clock=clock)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # seq_id -> live request
        self.num_preemptions = 0
        self.num_steps = 0
        self.watermark_blocks = int(config.watermark * num_blocks)
        # seq_id -> (cache version, match) of waiting requests: re-matched only when the cache changed
        self._match_cache: dict[str, tuple[int, MatchResult]] = {}
        self.num_deferred_promotions = 0  # requests admitted with loads beside the forward (TierConnector.load_async)
        self.num_draft_tokens = 0  # speculative tokens proposed ...
        self.num_accepted_tokens = 0  # ... and accepted
        # max_admitted_prefill_tokens: the cap it starts from (None: no cap), and with "auto" how many
        # times it doubled since a pass last got through the queue
        cap = config.max_admitted_prefill_tokens
        self._admission_cap_base = (None if config.policy == "static" or cap is None
                                    else AUTO_ADMITTED_PREFILL_TOKENS if cap == "auto" else cap)
        self._admission_cap_grows = cap == "auto"
        self._admission_cap_doublings = 0

    # ------------------------------------------------------------------ queue management
    def add_request(self, req: Request) -> None:
        if req.seq_id in self.requests:
            raise ValueError(f"request_id: {req.request_id!r} is already in use")
        self.requests[req.seq_id] = req
        req.wait_start_step = self.num_steps
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """Finish or abort a live request; its blocks are freed at once."""
        assert status.finished
        if req.is_finished:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req.seq_id)
        self._match_cache.pop(req.seq_id, None)
        del self.requests[req.seq_id]

    # ------------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        self.num_steps += 1
        self.tiers.begin_step(bool(self.running))
        budget = self.config.max_num_batched_tokens
        decodes: list[ScheduledRequest] = []
        prefills: list[ScheduledRequest] = []
        copy_ops: list[CopyOp] = []
        preempted: list[Request] = []
        out_of_memory: list[Request] = []

        kv, running = self.kv, self.running
        chunked = self.config.enable_chunked_prefill
        deferred: list[Request] = []  # admitted with lower-tier loads, computed from the next step
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            num_tokens, computed = len(req.token_ids), req.num_computed_tokens
            num_new = num_tokens - computed
            if num_new > budget:
                if not chunked and (decodes or prefills):
                    i += 1
                    continue
                num_new = budget
            ops = kv.allocate_slots(req.seq_id, computed, num_new)
            while ops is None:
                if len(running) == 1:
                    # alone and still out of blocks: the whole cache cannot hold it; stop it
                    self.finish_request(req, RequestStatus.FINISHED_LENGTH)
                    out_of_memory.append(req)
                    break
                victim = running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
                ops = kv.allocate_slots(req.seq_id, computed, num_new)
            if ops is None:
                break  # req itself was preempted or stopped: nobody younger is left
            if ops:
                copy_ops.extend(ops)
            end = computed + num_new
            kv.cache_blocks(req.seq_id, req.token_ids, end, req.block_hashes, req.cache_root,
                            *req.cache_tenant)
            samples = 0
            if end >= num_tokens:
                samples = req.sampling_params.n if req.needs_fork else 1
            sched = ScheduledRequest(req, num_new, computed, samples)
            (decodes if num_new == 1 and end == num_tokens else prefills).append(sched)
            budget -= num_new
            i += 1

        if not preempted and not out_of_memory and self._may_admit():
            budget = self._admit(budget, prefills, deferred)
        if self.config.num_speculative_tokens and decodes and budget > 0:
            budget = self._add_drafts(budget, decodes, prefills)

        scheduled = decodes + prefills
        for s, delta in zip(scheduled, self.kv.take_table_deltas([s.req.seq_id for s in scheduled])):
            req = s.req
            c = s.num_computed_tokens
            s.token_ids = [req.token_ids[c], *s.draft] if s.draft else req.token_ids[c:c + s.num_scheduled_tokens].tolist()
            s.block_delta = delta
        return SchedulerOutput(
            scheduled=scheduled,
            num_decodes=len(decodes),
            copy_ops=copy_ops,
            preempted=preempted,
            out_of_memory=out_of_memory,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            # kept for a step that reaches the runner
            released_seq_ids=self.kv.take_released() if scheduled else [],
            tiers=self.tiers.take_plan(deferred),
        )

    def _scheduled(self, req: Request, num_new: int) -> ScheduledRequest:
        end = req.num_computed_tokens + num_new
        samples = 0
        if end >= req.num_tokens:  # > : a decode with a draft
            samples = req.sampling_params.n if req.needs_fork else 1
        return ScheduledRequest(req, num_new, req.num_computed_tokens, samples)

    def _add_drafts(self, budget: int, decodes: list[ScheduledRequest], prefills: list[ScheduledRequest]) -> int:
        """Second pass: extend decodes (oldest first) with speculative drafts, from what is left of
        the budget once every running and newly admitted request got its tokens, and only into free
        blocks above the watermark (a draft never evicts a cached prefix or preempts anyone). A
        decode with a draft becomes a multi-token row: it moves to the prefill part of the batch."""
        cfg = self.config
        limit = cfg.speculative_disable_by_batch_size
        if limit is not None and len(self.running) + len(self.waiting) >= limit:
            return budget
        kept = []
        for sched in decodes:
            req = sched.req
            draft = self._propose(req, budget) if budget > 0 else []
            if not draft or not self.kv.extend(req.seq_id, req.num_tokens + len(draft), self.watermark_blocks):
                kept.append(sched)
                continue
            sched.draft = draft
            sched.num_scheduled_tokens = 1 + len(draft)
            self.num_draft_tokens += len(draft)
            budget -= len(draft)
            prefills.insert(0, sched)
        decodes[:] = kept
        return budget

    def _propose(self, req: Request, budget: int) -> list[int]:
        """Draft tokens for a decode (see spec_decode.py), within ``budget``, the request's
        max_tokens and the model's context."""
        cfg = self.config
        if not req.can_speculate:
            return []
        k = min(cfg.num_speculative_tokens, budget)
        p = req.sampling_params
        if p.max_tokens is not None:
            k = min(k, p.max_tokens - req.num_output_tokens - 1)
        if self.max_model_len is not None:
            k = min(k, self.max_model_len - req.num_tokens)
        if k <= 0:
            return []
        if req.ngram is None:
            req.ngram = NgramIndex(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        return req.ngram.propose(req.token_ids, k)

    def _may_admit(self) -> bool:
        if self.config.policy == "continuous":
            return True
        # static: admit only while no running request has started decoding
        return all(r.num_computed_tokens < r.num_prompt_tokens for r in self.running)

    @property
    def num_seats(self) -> int:
        """Sequences running now, counting an n > 1 request that has not forked yet as n."""
        return sum(r.sampling_params.n if r.needs_fork else 1 for r in self.running)

    def wait_steps(self, req: Request) -> int:
        """Steps that passed over ``req`` while it waited (counted at schedule time, no per-step
        loop over the queue)."""
        return self.num_steps - 1 - req.wait_start_step

    def _admission_order(self) -> list[tuple[Request, MatchResult]]:
        window = self.waiting[:_ORDER_WINDOW]
        version, cache = self.kv.version, self._match_cache
        cands = []
        for r in window:
            hit = cache.get(r.seq_id)
            if hit is None or hit[0] != version:
                hit = cache[r.seq_id] = (version, self.kv.match_prefix(r.token_ids, r.block_hashes, touch=False,
                                                                       root=r.cache_root))
            cands.append((r, hit[1]))
        max_wait = self.config.max_wait_steps

        def key(item: tuple[Request, MatchResult]):
            r, m = item
            urgent = r.num_preemptions > 0 or self.wait_steps(r) >= max_wait
            return (0, r.arrival_order, 0) if urgent else (1, -m.num_tokens, r.arrival_order)

        cands.sort(key=key)
        return cands

    def _lookup(self, req: Request, touch: bool = True) -> MatchResult:
        """The prefix ``req`` can start from: the device's cached pages and what the lower tiers
        hold beyond them. A request that wants its prompt's logprobs computes every prompt token."""
        if req.sampling_params.prompt_logprobs is not None:
            return self.kv.match_prefix(())
        return self.kv.match_prefix(req.token_ids, req.block_hashes, touch=touch, lower=True,
                                    root=req.cache_root)

    def _prefetch_ahead(self, reqs: list[Request]) -> None:
        """Start the file reads of waiting requests that this pass does not admit, so that their
        pages are in memory when their turn comes (a hint: a stale match only reads in vain)."""
        if self.tiers.reads is None:
            return
        for req in reqs[:_PREFETCH_AHEAD]:
            self.tiers.prefetch(self._lookup(req, touch=False).lower)

    @property
    def admission_cap(self) -> int | None:
        """This step's max_admitted_prefill_tokens (None: the token budget alone)."""
        base = self._admission_cap_base
        if base is None or not self._admission_cap_doublings:
            return base
        return min(base << self._admission_cap_doublings, max(base, self.config.max_num_batched_tokens))

    def _admission_closed(self, budget: int) -> bool:
        """Nobody can be admitted this step: no budget, no seat, or (with others running) not one
        page above the watermark."""
        if budget <= 0 or len(self.running) >= self.config.max_num_seqs:  # (seats >= running sequences)
            return True
        return (self.num_seats >= self.config.max_num_seqs
                or bool(self.running) and self.kv.num_reclaimable_blocks <= self.watermark_blocks)

    def _admit(self, budget: int, prefills: list[ScheduledRequest], deferred: list[Request]) -> int:
        """Admit waiting requests in ``_admission_order`` while the budget, the seats, the pages and
        the admission cap allow; those whose pages are still being read from files wait while the
        others go on. Returns what is left of the budget."""
        if not self.waiting:
            self._admission_cap_doublings = 0  # (a burst aborted while waiting starts nothing)
            return budget
        if self._admission_closed(budget):  # match nobody, but start the reads of those who come next
            self._prefetch_ahead(self.waiting)
            return budget
        seats, admitted_tokens = self.num_seats, 0  # admitted_tokens: prompt tokens scheduled for those admitted
        admitted: list[Request] = []
        cap, held = self.admission_cap, False  # held: whether the cap held a request back
        order = self._admission_order()
        rest = None  # where admission stopped: those from there on get their reads started
        for pos, (req, _) in enumerate(order):
            n = req.sampling_params.n if req.needs_fork else 1
            if budget <= 0 or seats + n > self.config.max_num_seqs and (self.running or admitted):
                rest = pos
                break
            # match again: it touches the LRU and counts pages cached by requests admitted just now
            hit = self._lookup(req)
            defer = self.tiers.load_async and bool(hit.lower or self.tiers.loads_into(hit.blocks))
            uncached = req.num_tokens - hit.num_tokens
            num_new = 0 if defer else uncached
            if cap is not None and admitted_tokens >= cap and uncached <= budget:
                # it would finish its prefill in this step (or, its pages loaded beside this step,
                # in the next) beside those admitted: it comes a step later; one that only starts
                # a chunked prefill is still admitted
                rest, held = pos, True
                break
            fits = num_new <= budget or self.config.enable_chunked_prefill or not (self.running or admitted)
            # its pages from files: read, or (if it would be admitted now) read within the worker's
            # bounded wait; else it waits, the others go on
            if not self.tiers.ready(hit.lower, wait=fits):
                continue
            if not fits:
                rest = pos + 1
                break
            num_new = min(num_new, budget)
            if not self._start(req, hit, num_new, reserve=self.watermark_blocks if self.running or admitted else 0):
                rest = pos + 1
                break
            admitted.append(req)
            seats += n
            if defer:  # its pages come in beside this step's forward; its tokens from the next step
                deferred.append(req)
                self.num_deferred_promotions += 1
                admitted_tokens += uncached  # prefilled in the next step, counted here
                continue
            prefills.append(self._scheduled(req, num_new))
            budget -= num_new
            admitted_tokens += num_new
        self._grow_admission_cap(held, rest is None)
        if rest is not None:
            self._prefetch_ahead([r for r, _ in order[rest:rest + _PREFETCH_AHEAD]])
        if admitted:  # all from the ordering window at the head of the queue
            ids = {id(r) for r in admitted}
            self.waiting[:_ORDER_WINDOW] = [r for r in self.waiting[:_ORDER_WINDOW] if id(r) not in ids]
        return budget

    def _start(self, req: Request, hit: MatchResult, num_new: int, reserve: int) -> bool:
        """Give ``req`` its tables (starting with ``hit``) for ``num_new`` tokens after the hit and
        make it running; False, and nothing changed, if the pages cannot be had."""
        cached = hit.num_tokens
        if self.kv.allocate_slots(req.seq_id, cached, num_new, prefix=hit, reserve=reserve) is None:
            return False
        if req.num_computed_tokens == 0 and req.num_preemptions == 0:
            req.num_cached_tokens = cached
            lower = len({r.index for r in hit.lower})
            self.kv.record_query(req.num_tokens, cached, lower * self.block_size)
            p = req.sampling_params
            if p.kv_retention_ttl_s is not None:
                self.kv.retain(req.token_ids, p.kv_retention_tokens or req.num_prompt_tokens, p.kv_retention_ttl_s,
                               req.block_hashes, req.cache_root, p.kv_retention_handle)
        req.num_computed_tokens = cached
        self.kv.cache_blocks(req.seq_id, req.token_ids, cached + num_new, req.block_hashes, req.cache_root,
                             *req.cache_tenant)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self._match_cache.pop(req.seq_id, None)
        return True

    def _grow_admission_cap(self, held: bool, got_through: bool) -> None:
        """With "auto": doubled while it holds requests back, back to its start once a pass got
        through the queue; a pass that stopped for the budget, seats or pages leaves it as it is
        (a burst larger than a step's budget keeps the cap it reached)."""
        if not self._admission_cap_grows:
            return
        if held:
            self._admission_cap_doublings = min(self._admission_cap_doublings + 1, 30)
        elif got_through:
            self._admission_cap_doublings = 0

    def reset_cache(self, failed: SchedulerOutput | None = None) -> None:
        """After a step failed (``failed``, or an interrupted one): every cached page no request
        holds goes, on the device and in the host tier, and the files that step was to write
        (their KV can no longer be trusted)."""
        self.kv.reset_cache()
        self.tiers.reset(failed.tiers if failed is not None else TierPlan())

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.seq_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        req.wait_start_step = self.num_steps
        self.num_preemptions += 1
        self.waiting.insert(0, req)

    def update(self, out: SchedulerOutput, sampled: list[list[int]],
               errors: list[tuple[Request, BaseException]] | None = None) -> list[Request]:
        """Record a step's results. ``sampled[i]`` holds the tokens sampled for
        ``out.scheduled[i]`` (``num_samples`` of them, or none; for a decode with a draft, the
        accepted draft tokens and the next token). Returns the requests that got new tokens,
        forked children included, in batch order. With ``errors`` given, an exception while
        recording one request is appended there (the caller frees that request) and the rest go
        on; without it, it propagates."""
        changed: list[Request] = []
        for sched, toks in zip(out.scheduled, sampled):
            try:
                self._update_one(sched, toks, changed)
            except Exception as e:
                if errors is None:
                    raise
                errors.append((sched.req, e))
        return changed

    def _update_one(self, sched: ScheduledRequest, toks: list[int], changed: list[Request]) -> None:
        req = sched.req
        if req.is_finished or req.status != RequestStatus.RUNNING:
            return  # aborted meanwhile
        if sched.draft:
            # toks = the accepted draft tokens + the model's next one; the KV of the last known
            # token and of the accepted draft tokens is now valid, the rest is overwritten later
            assert 1 <= len(toks) <= len(sched.draft) + 1, (toks, sched.draft)
            req.num_computed_tokens = sched.num_computed_tokens + len(toks)
            req.token_ids.extend(toks)
            self.kv.cache_blocks(req.seq_id, req.token_ids, req.num_computed_tokens, req.block_hashes,
                                  req.cache_root, *req.cache_tenant)
            self.kv.trim(req.seq_id, req.num_tokens)  # blocks that held only rejected tokens
            self.num_accepted_tokens += len(toks) - 1
            changed.append(req)
            return
        req.num_computed_tokens = sched.num_computed_tokens + sched.num_scheduled_tokens
        if not sched.num_samples:
            return
        assert len(toks) == sched.num_samples, (len(toks), sched.num_samples)
        if req.needs_fork:
            changed.extend(self._fork(req, toks[1:]))
            req.needs_fork = False
        req.token_ids.append(toks[0])
        changed.append(req)

    def _fork(self, parent: Request, child_tokens: list[int]) -> list[Request]:
        children = []
        pos = self.running.index(parent) + 1
        for k, tok in enumerate(child_tokens, start=1):
            child = parent.fork(k)
            self.kv.fork(parent.seq_id, child.seq_id)
            child.token_ids.append(tok)
            self.requests[child.seq_id] = child
            self.running.insert(pos, child)
            pos += 1
            children.append(child)
        return children

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        live = {r.seq_id for r in self.running}
        assert set(self.kv.block_tables) == live, (
            f"tables for {sorted(self.kv.block_tables)} but running {sorted(live)}")
        bs = self.block_size
        for r in self.running:
            tables = self.kv.block_tables[r.seq_id]
            assert len(tables[0]) * bs >= r.num_computed_tokens, (r, tables)
