"""Request routers for the engine replicas (Ray Serve ``RequestRouter`` subclasses; they run in the
process of the caller, the ingress).

Both prefixkv routers route on what each replica's prefix cache really holds: every replica
publishes its cache digest (block hash -> tier, serve/replica.py) and its load (serve/load.py)
through Serve's routing stats, which replace the router's view of it every
``request_routing_stats_period_s``; an eviction on a replica leaves its digest by the next period.
Between two digests a router counts a request it routed as cached where it went (the blocks its
prompt will leave there), until that replica has published two digests after the request ended:
so a burst sharing a new prefix sees where its first request went, and what the replica then
evicts is what the digest says. A request is matched by its ``routing_keys``.

``cache_view="events"`` (``--routing-cache-view events``, both prefixkv routers) reads each
replica's KV events instead of its digest: the router subscribes to every replica's own endpoints
(serve/kv_subscriber.py; the replica's stats name them) and keeps per replica the blocks each
medium holds (serve/block_view.py), so what a replica stores or evicts counts from the step it
happened, and a routed request stops counting as cached there once a batch published after its end
has arrived. The events carry the replica's hash chain in its published form (``event_keys``): the
salt and partition are in it, so a salted request matches only its salt's blocks. A view that lost
batches the replay could not give back matches the digest as well until a digest taken after the
loss is folded in. Blocks that a replica's retained prefixes cover (``retained`` in its stats,
kv/retention.py) count as held there in either view.

``CacheAwareRouter`` (the default, ``--router cache_aware``) weighs, for each candidate replica
r, the request's expected time to first token there and the time its prefill takes from the
requests it shares r with, and picks the smallest::

    cost(r) = ttft(r) + N_r * U_r / rate
    ttft(r) = (P_r + U_r) / rate + N_r * step          U_r = L - H_r

    L       the prompt's tokens;  H_r  the tokens of its prefix that r holds (whole blocks)
    U_r     the prompt tokens r would compute
    N_r     requests on r ahead of it: running + waiting as r last reported them, plus those this
            router sent r since that report, minus those of the report that ended since
    P_r     prompt tokens still to compute on r: r's report, plus the uncached tokens of what
            this router sent r since it
    rate    the measured prefill rate (tokens/s); step  the measured decode step time (s)

``ttft``: the prefill queued ahead, then its own, and a step for each request ahead (the steps it
shares or waits for). The second term of ``cost``: every step of its prefill delays the requests
running beside it, and as many will queue behind it while the queue stays as long as it is: a
request that leaves its cached prefix for a shorter queue makes everyone there wait for the
prefill it brings. Without that term (TTFT alone) a loaded service moves requests off their
prefixes whenever the queues differ by one prompt's prefill, and computes prefixes twice: on the
shared-prefix traffic of bench/ray_routing.py at 2 requests/s, TTFT alone moved 11 of 72 requests
and hit 0.49 of the prompt tokens against 0.63 for the threshold rule (2026-12-05, bench/RESULTS.md).
A long cached prefix wins over a short queue (it saves its own prefill and everyone's wait); a
two-block template prefix does not win over an idle replica (it saves less than a step per
request there), and a burst spreads (every request it reserves makes a replica dearer). Ties go
to the replica holding more of the prompt, then fewer requests, then caching less (a cold prefix
goes where it displaces the least).

A request counts against its replica from the decision on (``choose_replicas`` reserves it there;
routing to a fallback moves it; completion, failure, refusal, a cancelled request and the
replica's death release it), so requests routed together see each other: a burst of unrelated
requests lands evenly. A replica's report replaces the reservations it covers: those made before
its time are in its counts (the replicas' clocks and the ingress's: one host, or NTP), though never
below the number of this router's requests there that have not ended (one routed just before a
report may still be in transit to the replica).

The speeds are the replicas' own measurements (serve/load.py). By default (``speeds=
"deployment"``) every replica is weighed at their median: the replicas of a deployment run one
engine config on one kind of node, and what their measurements differ by is mostly noise (a few
steps' timings, the sizes of the prompts each happened to get), which would skew the spread of a
burst and send a cold prefix to whichever replica measured faster rather than where it displaces
the least. ``speeds="replica"`` weighs each at its own (replicas on unlike nodes). Until some
replica has measured, ``DEFAULT_PREFILL_TOKENS_PER_S`` / ``DEFAULT_DECODE_STEP_S``.

Decisions are counted by reason: ``prefix`` (the chosen replica holds part of the prompt),
``queue`` (another held more, but its queue made it dearer), ``no_match`` (none held any).

``CacheThresholdRouter`` (``--router cache_threshold``, the rule before the cost model, kept for
comparison; SGLang's router and Ray LLM's prefix router work so) sends a request to the replica
holding the longest cached prefix (device-tier blocks break ties, then load), if that prefix is
at least ``min_match_tokens`` long and that replica's load (requests this router has in flight on
it, counted when routed) exceeds the least loaded one's by at most ``imbalanced_threshold``;
otherwise to the least loaded, ties to fewer cached blocks.

In both, the other replicas, in ``choose_replicas``' returned order, are the fallbacks if the
chosen one refuses (its ``max_ongoing_requests``). ``PowerOfTwoRouter`` (Serve's default) and
``PrefixAffinityRouter`` (Ray Serve LLM's ``PrefixCacheAffinityRouter``, an approximate tree of
routed prompts per replica, here fed the prompt's token ids as characters) are the same routers
with the bookkeeping the ingress's ``/metrics`` and ``/health`` read, for comparison
(bench/ray_routing.py).
"""

from __future__ import annotations

import collections
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from prefixkv.kv.hashing import U64, BlockHasher, first_block_keys
from prefixkv.kv.keys import cache_root
from prefixkv.serve import registry
from prefixkv.serve.block_view import BlockView
from prefixkv.serve.digest import PrefixMatch, match_digest, prompt_block_hashes
from prefixkv.serve.kv_subscriber import EventSubscriber
from prefixkv.serve.load import ReplicaLoad
from prefixkv.serve.replica import ReplicaRequest

DEFAULT_IMBALANCED_THRESHOLD = 16  # requests in flight (SGLang's router: 32; Ray LLM's prefix router: inf)
DEFAULT_MIN_MATCH_TOKENS = 1  # one whole cached block is worth following
# until some replica has measured its own (serve/load.py): the order of a small model on one CPU core
DEFAULT_PREFILL_TOKENS_PER_S = 1000.0
DEFAULT_DECODE_STEP_S = 0.05
SPEEDS = ("deployment", "replica")  # whose measured speeds weigh a replica: the median of all, or its own
CACHE_VIEWS = ("digests", "events")  # what a router knows of a replica's cache: its periodic digest, or its KV events


def routing_keys(req: ReplicaRequest, block_size: int) -> list[int]:
    """The keys a request is matched by against the replicas' digests and the prompts routed
    before it: the chain hashes of its prompt's full blocks (``digest.prompt_block_hashes``, the
    radix index's), from the root of its cache salt and partition (``kv.keys.cache_root``, the
    engine's ``Request.cache_root``): a request matches only blocks its own tenant cached."""
    p = req.params
    return prompt_block_hashes(req.prompt_token_ids, block_size, cache_root(p.cache_salt, p.cache_partition))


def _block_size(replicas: list[RunningReplica]) -> int:
    """The replicas' KV block size, as they publish it (one engine config: the same for all)."""
    return next((r.routing_stats["block_size"] for r in replicas if r.routing_stats.get("block_size")), 16)


def _request_of(pending: PendingRequest | None) -> ReplicaRequest | None:
    if pending is None:
        return None
    return next((a for a in pending.args if isinstance(a, ReplicaRequest)), None)


class _Observed:
    """Bookkeeping common to the routers: the replicas' routing stats and the decisions taken."""

    def _register(self) -> None:
        # decisions by reason, one per choose_replicas call for a request (a retry after every
        # chosen replica refused counts again)
        self.decisions: collections.Counter[str] = collections.Counter()
        self.routed: collections.Counter[str] = collections.Counter()  # replica -> requests routed
        registry.register(self._deployment_id.name, self)

    def routing_stats(self) -> dict[str, dict[str, Any]]:
        """replica id -> its last published routing stats (digest, load, engine statistics)."""
        return {rid.unique_id: dict(r.routing_stats) for rid, r in list(self.curr_replicas.items())}

    def in_flight(self) -> dict[str, int]:
        """replica id -> requests this router counts against it (none for Ray's own routers)."""
        return {}

    def cache_views(self) -> dict[str, dict[str, Any]]:
        """replica id -> the state of its event-fed cache view (``cache_view="events"``; none else)."""
        sub = getattr(self, "_subscriber", None)
        if sub is None:
            return {}
        out = {}
        for rid in list(self.curr_replicas):
            view = sub.view(rid.unique_id)
            if view is not None:
                out[rid.unique_id] = {"synced": view.synced, "num_blocks": view.num_blocks,
                                      "num_batches": view.num_batches, "num_lost": view.num_lost}
        return out

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        super().on_request_routed(pending_request, replica_id, result)  # Ray LLM's router records its tree here
        req = _request_of(pending_request)
        if req is not None:
            self.routed[replica_id.unique_id] += 1
            self._routed(pending_request.metadata.internal_request_id, req, replica_id)

    def _routed(self, rid: str, req: ReplicaRequest, replica_id: ReplicaID) -> None:
        """The router's own bookkeeping of a request the replica accepted."""


class _Counted(_Observed):
    """One of Ray's routers as it is, its decisions counted under ``decision``."""

    decision: str

    def initialize_state(self, **kwargs: Any) -> None:
        self._register()
        super().initialize_state(**kwargs)

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if _request_of(pending_request) is not None:
            self.decisions[self.decision] += 1
        return await super().choose_replicas(candidate_replicas, pending_request)


class PowerOfTwoRouter(_Counted, PowerOfTwoChoicesRequestRouter):
    decision = "power_of_two"


def _prefix_affinity_base() -> type:
    # Ray Serve LLM's public import path (ray.serve.llm.request_router, a subclass adding
    # nothing) insists on pyarrow and vLLM or SGLang being installed; the router itself needs neither
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
        PrefixCacheAffinityRouter,
    )

    return PrefixCacheAffinityRouter


class PrefixAffinityRouter(_Counted, _prefix_affinity_base()):
    decision = "prefix_affinity"


def event_keys(req: ReplicaRequest, keys: list[int], block_size: int, kv_events: dict[str, Any]) -> list[int | bytes]:
    """A request's ``routing_keys`` in the form its replica's KV events carry them: with
    ``--prefix-caching-hash-algo builtin`` the same chain, published as its low 64 bits unsigned;
    with vLLM's algorithms the chain of that function from the replica's root (salt and partition
    in the first block's extra keys, as the engine hashes them), published the same way."""
    algo = kv_events.get("hash_algo") or "builtin"
    if algo == "builtin":
        return [k & U64 for k in keys]
    hasher = BlockHasher(algo, bytes.fromhex(kv_events["hash_root"]))
    p = req.params
    chain = hasher.extend([], req.prompt_token_ids[:len(keys) * block_size], block_size,
                          first_block_keys(p.cache_salt, p.cache_partition))
    return [hasher.external(h) for h in chain]


class _PrefixView:
    """What each replica holds of a prompt: its last digest or the view its KV events keep
    (``cache_view``), the blocks its retained prefixes cover, and the prompts routed there that
    neither may show yet (in flight, or ended less than two of its digests ago, or, with events,
    before the last batch it published)."""

    def _init_view(self, cache_view: str = "digests") -> None:
        if cache_view not in CACHE_VIEWS:
            raise ValueError(f"cache_view: must be one of {', '.join(CACHE_VIEWS)}, got {cache_view!r}")
        self.cache_view = cache_view
        self._subscriber: EventSubscriber | None = EventSubscriber() if cache_view == "events" else None
        # replica -> {internal request id: [routing keys, digest seq at its end or None, time.time() at its end]}
        self._recent: dict[ReplicaID, dict[str, list]] = collections.defaultdict(dict)
        self._event_keys_memo: tuple[Any, ...] = (None,)

    def _remember(self, replica_id: ReplicaID, rid: str, keys: list[int]) -> None:
        self._recent[replica_id][rid] = [keys, None, math.inf]

    def _forget(self, replica_id: ReplicaID, rid: str) -> None:
        self._recent.get(replica_id, {}).pop(rid, None)

    def _ended(self, replica_id: ReplicaID, rid: str) -> None:
        entry = self._recent.get(replica_id, {}).get(rid)
        if entry is not None:
            r = self.curr_replicas.get(replica_id)
            entry[1] = r.routing_stats.get("seq", 0) if r is not None else 0
            entry[2] = time.time()

    def _events_of(self, r: RunningReplica) -> BlockView | None:
        """``r``'s event-fed view (``cache_view="events"``), once its stats name its endpoints; a view
        that lost batches takes in the first digest ``r`` published after the loss. None: digests
        (also when the subscriber failed)."""
        if self._subscriber is None or self._subscriber.failed:
            return None
        info = r.routing_stats.get("kv_events")
        if not info:
            return None
        view = self._subscriber.watch(r.replica_id.unique_id, info["endpoint"], info.get("replay_endpoint"),
                                      info.get("topic") or "")
        if not view.synced and (info.get("hash_algo") or "builtin") == "builtin" and "time" in r.routing_stats:
            view.fold_digest(r.routing_stats.get("digest") or {}, r.routing_stats["time"], lambda h: h & U64)
        return view

    def _expire(self, r: RunningReplica) -> None:
        """Drop the routed requests whose blocks ``r``'s cache view now tells (or no longer holds):
        those that ended two digests ago, or, with events, before the last batch the view applied."""
        recent = self._recent.get(r.replica_id)
        if recent:
            seq = r.routing_stats.get("seq", 0)
            view = self._events_of(r)
            told = view.last_ts if view is not None and view.synced else -math.inf
            for rid in [rid for rid, (_, end_seq, end) in recent.items()
                        if end_seq is not None and (seq >= end_seq + 2 or end < told)]:
                del recent[rid]

    def _held(self, r: RunningReplica, keys: list[int], req: ReplicaRequest | None) -> PrefixMatch:
        """The leading blocks of ``keys`` that ``r``'s cache view holds: its events' view (while it
        is whole, else the longer of it and the digest) or its digest; blocks its retained prefixes
        cover count as held in any case (a digest cut to its bound, or a view that lost batches,
        may not show them; the replica keeps them while anything else can go)."""
        digest = r.routing_stats.get("digest") or {}
        retained = r.routing_stats.get("retained") or ()
        view = self._events_of(r) if req is not None else None
        if view is None:
            best = match_digest(keys, digest)
        else:
            info = r.routing_stats["kv_events"]
            memo = self._event_keys_memo
            if memo[0] is not req or memo[1] != (info.get("hash_algo"), info.get("hash_root")):
                ek = event_keys(req, keys, _block_size([r]), info)
                self._event_keys_memo = memo = (req, (info.get("hash_algo"), info.get("hash_root")), ek)
            best = view.match(memo[2])
            if not view.synced:
                best = max(best, match_digest(keys, digest))
        if retained and best.num_blocks < len(keys):
            kept, n = set(retained), best.num_blocks
            while n < len(keys) and keys[n] in kept:
                n += 1
            best = PrefixMatch(n, best.num_device_blocks)
        return best

    def _num_cached(self, r: RunningReplica) -> int:
        """How many blocks ``r`` caches, by its cache view (the tie-break: a cold prefix goes where
        it displaces the least)."""
        view = self._events_of(r)
        if view is not None and view.synced:
            return view.num_blocks
        return len(r.routing_stats.get("digest") or ())

    def _match(self, r: RunningReplica, keys: list[int], req: ReplicaRequest | None = None) -> PrefixMatch:
        best = self._held(r, keys, req)
        for h, *_ in self._recent.get(r.replica_id, {}).values():  # routed here, not yet in its view
            n = 0
            while n < len(h) and n < len(keys) and h[n] == keys[n]:
                n += 1
            if n > best.num_blocks:
                best = PrefixMatch(n, n)
        return best

    def _watch(self, replicas: list[RunningReplica]) -> None:
        """Subscribe to the events of the replicas whose stats name their endpoints (the stats come
        with ``update_replicas``), so a view is whole before a request needs it; stop following
        those gone."""
        if self._subscriber is not None:
            for r in replicas:
                self._events_of(r)
            for key in self._subscriber.keys() - {r.replica_id.unique_id for r in replicas}:
                self._subscriber.unwatch(key)

    def _drop_view(self, replica_id: ReplicaID) -> None:
        self._recent.pop(replica_id, None)
        if self._subscriber is not None:
            self._subscriber.unwatch(replica_id.unique_id)


class CacheThresholdRouter(_Observed, _PrefixView, LocalityMixin, MultiplexMixin, RequestRouter):
    def initialize_state(self, imbalanced_threshold: int = DEFAULT_IMBALANCED_THRESHOLD,
                         min_match_tokens: int = DEFAULT_MIN_MATCH_TOKENS, cache_view: str = "digests",
                         **kwargs: Any) -> None:
        if imbalanced_threshold < 0:
            raise ValueError(f"imbalanced_threshold: must be >= 0, got {imbalanced_threshold}")
        if min_match_tokens < 1:
            raise ValueError(f"min_match_tokens: must be >= 1, got {min_match_tokens}")
        self._init_view(cache_view)
        self._register()
        self.imbalanced_threshold = imbalanced_threshold
        self.min_match_tokens = min_match_tokens
        self._in_flight: collections.Counter[ReplicaID] = collections.Counter()
        self._where: dict[str, ReplicaID] = {}  # internal request id -> replica, while in flight

    def in_flight(self) -> dict[str, int]:
        return {rid.unique_id: n for rid, n in list(self._in_flight.items())}  # (read from the ingress's thread)

    # ------------------------------------------------------------------ decisions
    def _load(self, r: RunningReplica) -> int:
        return self._in_flight[r.replica_id]

    def choose(self, candidates: list[RunningReplica], req: ReplicaRequest) -> tuple[RunningReplica, str, int]:
        """(replica, reason, matched tokens) for one request: the routing decision, no I/O."""
        block_size = _block_size(candidates)
        keys = routing_keys(req, block_size)
        least = min(self._load(r) for r in candidates)
        for r in candidates:
            self._expire(r)
        matches = [self._match(r, keys, req) for r in candidates]
        i = max(range(len(candidates)), key=lambda i: (matches[i].num_blocks, matches[i].num_device_blocks,
                                                         -self._load(candidates[i])))
        if matches[i].num_blocks and matches[i].num_blocks * block_size >= self.min_match_tokens:
            if self._load(candidates[i]) - least <= self.imbalanced_threshold:
                return candidates[i], "prefix", matches[i].num_blocks * block_size
            reason = "imbalanced"
        else:
            reason = "no_match"
        j = min(range(len(candidates)), key=lambda j: (self._load(candidates[j]), self._num_cached(candidates[j])))
        return candidates[j], reason, matches[j].num_blocks * block_size

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        req = _request_of(pending_request)
        if req is None or not candidate_replicas:  # describe() and the like: any replica
            return [candidate_replicas]
        chosen, reason, _ = self.choose(candidate_replicas, req)
        self.decisions[reason] += 1
        rest = sorted((r for r in candidate_replicas if r is not chosen), key=self._load)
        return [[chosen]] + ([rest] if rest else [])

    # ------------------------------------------------------------------ bookkeeping
    def _routed(self, rid: str, req: ReplicaRequest, replica_id: ReplicaID) -> None:
        self._in_flight[replica_id] += 1
        self._where[rid] = replica_id
        self._remember(replica_id, rid, routing_keys(req, _block_size(list(self.curr_replicas.values()))))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._where.pop(internal_request_id, None) is None:
            return
        self._in_flight[replica_id] -= 1
        if self._in_flight[replica_id] <= 0:
            del self._in_flight[replica_id]
        self._ended(replica_id, internal_request_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._watch(replicas)
        alive = {r.replica_id for r in replicas}
        for gone in [rid for rid in self._recent if rid not in alive]:  # a dead replica's state goes
            self._drop_view(gone)
            self._in_flight.pop(gone, None)
        for rid, where in list(self._where.items()):
            if where not in alive:
                del self._where[rid]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._drop_view(replica_id)
        self._in_flight.pop(replica_id, None)


@dataclass(slots=True)
class _Reservation:
    """A request counted against a replica, from the routing decision until it ends there."""

    replica_id: ReplicaID
    time: float  # time.time() of the decision (or of the routing, when it moved)
    num_prefill_tokens: int  # the prompt's tokens the replica did not hold at the decision
    pending: PendingRequest | None  # until routed: a cancelled one is released


class Estimate(NamedTuple):
    """One candidate replica for one request, as ``CacheAwareRouter`` weighs it."""

    cost_s: float  # what the decision minimises
    ttft_s: float
    num_held_tokens: int  # H: of the prompt, in whole blocks
    num_requests: int  # N: ahead of it
    num_prefill_tokens: int  # P: prompt tokens still to compute ahead of it
    prefill_tokens_per_s: float
    decode_step_s: float


class Decision(NamedTuple):
    replica: RunningReplica
    reason: str
    estimates: list[Estimate]  # one per candidate, in their order
    keys: list[int]  # the request's routing_keys


class CacheAwareRouter(_Observed, _PrefixView, LocalityMixin, MultiplexMixin, RequestRouter):
    def initialize_state(self, speeds: str = "deployment",
                         default_prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S,
                         default_decode_step_s: float = DEFAULT_DECODE_STEP_S, cache_view: str = "digests",
                         **kwargs: Any) -> None:
        if speeds not in SPEEDS:
            raise ValueError(f"speeds: must be one of {', '.join(SPEEDS)}, got {speeds!r}")
        if not default_prefill_tokens_per_s > 0:
            raise ValueError(f"default_prefill_tokens_per_s: must be positive, got {default_prefill_tokens_per_s}")
        if not default_decode_step_s > 0:
            raise ValueError(f"default_decode_step_s: must be positive, got {default_decode_step_s}")
        self._init_view(cache_view)
        self._register()
        self.speeds = speeds
        self.default_prefill_tokens_per_s = default_prefill_tokens_per_s
        self.default_decode_step_s = default_decode_step_s
        self._reserved: dict[str, _Reservation] = {}  # internal request id -> its reservation
        self._by_replica: dict[ReplicaID, dict[str, _Reservation]] = collections.defaultdict(dict)
        # replica -> (reserved at, ended at) of requests that ended: those its last report still counts
        self._ended_at: dict[ReplicaID, list[tuple[float, float]]] = collections.defaultdict(list)

    def in_flight(self) -> dict[str, int]:
        return {rid.unique_id: len(res) for rid, res in list(self._by_replica.items()) if res}  # (another thread)

    # ------------------------------------------------------------------ the model
    def _speeds(self, candidates: list[RunningReplica]) -> list[tuple[float, float]]:
        """(prefill tokens/s, decode step s) per candidate: the median of the candidates'
        measurements (``speeds="deployment"``), or each one's own, unmeasured ones the median."""
        loads = [ReplicaLoad.of(r.routing_stats) for r in candidates]
        rates = [x.prefill_tokens_per_s for x in loads if x is not None and x.prefill_tokens_per_s]
        steps = [x.decode_step_s for x in loads if x is not None and x.decode_step_s]
        rate0 = statistics.median(rates) if rates else self.default_prefill_tokens_per_s
        step0 = statistics.median(steps) if steps else self.default_decode_step_s
        if self.speeds == "deployment":
            return [(rate0, step0)] * len(candidates)
        return [((x.prefill_tokens_per_s or rate0) if x else rate0, (x.decode_step_s or step0) if x else step0)
                for x in loads]

    def _queue(self, r: RunningReplica) -> tuple[int, int]:
        """(N, P): requests and prompt tokens ahead on ``r`` now, from its last report and what this
        router sent it since."""
        load = ReplicaLoad.of(r.routing_stats)
        seen = load.time if load is not None else -math.inf
        n, p = (load.num_requests, load.num_prefill_tokens) if load is not None else (0, 0)
        mine = self._by_replica.get(r.replica_id, {})
        for res in mine.values():
            if res.time > seen:  # routed after the report: not in it
                n += 1
                p += res.num_prefill_tokens
        ended = self._ended_at.get(r.replica_id)
        if ended:
            ended[:] = [(t0, t1) for t0, t1 in ended if t1 > seen]  # (reports only move forward)
            n -= sum(1 for t0, _ in ended if t0 <= seen)  # in the report, ended since
        # never fewer than this router's own requests there that have not ended: one routed just
        # before a report may still be on its way to the replica, in no queue the report counted
        return max(n, len(mine)), p

    def estimate(self, r: RunningReplica, keys: list[int], num_prompt_tokens: int, block_size: int,
                 speed: tuple[float, float], req: ReplicaRequest | None = None) -> Estimate:
        n, p = self._queue(r)
        held = self._match(r, keys, req).num_blocks * block_size  # (never the block of the last token)
        rate, step = speed
        uncached = num_prompt_tokens - held
        ttft = (p + uncached) / rate + n * step
        return Estimate(ttft + n * uncached / rate, ttft, held, n, p, rate, step)

    def choose(self, candidates: list[RunningReplica], req: ReplicaRequest) -> Decision:
        """The routing decision for one request (no reservation, no I/O)."""
        block_size = _block_size(candidates)
        keys = routing_keys(req, block_size)
        for r in candidates:
            self._expire(r)
        num_tokens = len(req.prompt_token_ids)
        est = [self.estimate(r, keys, num_tokens, block_size, s, req)
               for r, s in zip(candidates, self._speeds(candidates))]
        i = min(range(len(candidates)), key=lambda i: (est[i].cost_s, -est[i].num_held_tokens, est[i].num_requests,
                                                       self._num_cached(candidates[i]), i))
        reason = ("prefix" if est[i].num_held_tokens else
                  "queue" if any(e.num_held_tokens for e in est) else "no_match")
        return Decision(candidates[i], reason, est, keys)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        req = _request_of(pending_request)
        if req is None or not candidate_replicas:  # describe() and the like: any replica
            return [candidate_replicas]
        self._release_cancelled()
        d = self.choose(candidate_replicas, req)
        self.decisions[d.reason] += 1
        chosen = candidate_replicas.index(d.replica)
        num_tokens = len(req.prompt_token_ids)
        self._reserve(pending_request.metadata.internal_request_id, d.replica.replica_id,
                      num_tokens - d.estimates[chosen].num_held_tokens, d.keys, pending_request)
        order = sorted((i for i in range(len(candidate_replicas)) if i != chosen), key=lambda i: d.estimates[i].cost_s)
        rest = [candidate_replicas[i] for i in order]
        return [[d.replica]] + ([rest] if rest else [])

    # ------------------------------------------------------------------ reservations
    def _reserve(self, rid: str, replica_id: ReplicaID, num_prefill_tokens: int, keys: list[int],
                 pending: PendingRequest | None) -> _Reservation:
        self._release(rid, ended=False)  # a retry: its last decision's place goes
        res = _Reservation(replica_id, time.time(), num_prefill_tokens, pending)
        self._reserved[rid] = self._by_replica[replica_id][rid] = res
        self._remember(replica_id, rid, keys)
        return res

    def _release(self, rid: str, ended: bool) -> None:
        """``ended``: it ran on its replica (its prompt's blocks may be cached there)."""
        res = self._reserved.pop(rid, None)
        if res is None:
            return
        self._by_replica[res.replica_id].pop(rid, None)
        if ended:
            self._ended_at[res.replica_id].append((res.time, time.time()))
            self._ended(res.replica_id, rid)
        else:
            self._forget(res.replica_id, rid)

    def _release_cancelled(self) -> None:
        """Requests whose caller gave up before they were routed."""
        for rid in [rid for rid, res in self._reserved.items()
                    if res.pending is not None and res.pending.future.cancelled()]:
            self._release(rid, ended=False)

    def _routed(self, rid: str, req: ReplicaRequest, replica_id: ReplicaID) -> None:
        res = self._reserved.get(rid)
        if res is None or res.replica_id != replica_id:  # a fallback took it: it moves there
            r = self.curr_replicas.get(replica_id)
            block_size = _block_size([r] if r is not None else [])
            keys = routing_keys(req, block_size)
            num_tokens = len(req.prompt_token_ids)
            held = self._match(r, keys, req).num_blocks * block_size if r is not None else 0
            res = self._reserve(rid, replica_id, num_tokens - held, keys, None)
        res.pending = None
        self._cap(replica_id)

    def _cap(self, replica_id: ReplicaID) -> None:
        """A replica runs at most ``max_ongoing_requests`` of this router's requests: more
        reservations there would be ones whose end never came; the oldest go."""
        r = self.curr_replicas.get(replica_id)
        held = self._by_replica.get(replica_id, {})
        if r is not None and len(held) > r.max_ongoing_requests:
            routed = sorted((res.time, rid) for rid, res in held.items() if res.pending is None)
            for _, rid in routed[:len(held) - r.max_ongoing_requests]:
                self._release(rid, ended=False)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """Completed, failed, or refused by the replica (Serve then routes it again)."""
        res = self._reserved.get(internal_request_id)
        if res is not None and res.replica_id == replica_id:
            self._release(internal_request_id, ended=res.pending is None)

    def _drop_replica(self, replica_id: ReplicaID) -> None:
        for rid in list(self._by_replica.pop(replica_id, {})):
            self._reserved.pop(rid, None)
        self._ended_at.pop(replica_id, None)
        self._drop_view(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._watch(replicas)
        alive = {r.replica_id for r in replicas}
        for gone in {*self._by_replica, *self._recent, *self._ended_at} - alive:  # a dead replica's state goes
            self._drop_replica(gone)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._drop_replica(replica_id)
