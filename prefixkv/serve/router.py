"""Request routers for the engine replicas (Ray Serve ``RequestRouter`` subclasses; they run in the
process of the caller, the ingress).

``CacheAwareRouter`` routes on what each replica's prefix cache really holds: every replica
publishes its cache digest (block hash -> tier, serve/replica.py) through Serve's routing stats,
which replace the router's view of it every ``request_routing_stats_period_s``; an eviction on a
replica leaves its digest by the next period. A request goes to

1. the replica holding the longest cached prefix of its prompt (whole blocks; device-tier blocks
   break ties, then load), if that prefix is at least ``min_match_tokens`` long and that replica's
   load (requests this router has in flight on it) exceeds the least loaded one's by at most
   ``imbalanced_threshold``;
2. otherwise the least loaded replica, ties broken by fewer cached blocks (a cold prefix goes where
   it displaces the least).

Between two digests the router counts a request it routed as cached where it went (the blocks its
prompt will leave there), until that replica has published two digests after the request ended: so
a burst sharing a new prefix follows its first request without waiting a period, and what the
replica then evicts is what the digest says. The other replicas, in ``choose_replicas``' returned
order, are the fallbacks if the chosen one refuses (its ``max_ongoing_requests``).

``PowerOfTwoRouter`` (Serve's default) and ``PrefixAffinityRouter`` (Ray Serve LLM's
``PrefixCacheAffinityRouter``, an approximate tree of routed prompts per replica, here fed the
prompt's token ids as characters) are the same routers with the bookkeeping the ingress's
``/metrics`` and ``/health`` read, for comparison (bench/ray_routing.py).
"""

from __future__ import annotations

import collections
from typing import Any

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

from prefixkv.serve import registry
from prefixkv.serve.digest import PrefixMatch, match_digest, prompt_block_hashes
from prefixkv.serve.replica import ReplicaRequest

DEFAULT_IMBALANCED_THRESHOLD = 16  # requests in flight (SGLang's router: 32; Ray LLM's prefix router: inf)
DEFAULT_MIN_MATCH_TOKENS = 1  # one whole cached block is worth following


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
        """replica id -> its last published routing stats (digest, engine statistics)."""
        return {rid.unique_id: dict(r.routing_stats) for rid, r in list(self.curr_replicas.items())}

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        super().on_request_routed(pending_request, replica_id, result)  # Ray LLM's router records its tree here
        if _request_of(pending_request) is not None:
            self.routed[replica_id.unique_id] += 1


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
    # Ray Serve LLM's public import path insists on vLLM or SGLang being installed; the router
    # itself needs neither
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
        PrefixCacheAffinityRouter,
    )

    return PrefixCacheAffinityRouter


class PrefixAffinityRouter(_Counted, _prefix_affinity_base()):
    decision = "prefix_affinity"


class CacheAwareRouter(_Observed, LocalityMixin, MultiplexMixin, RequestRouter):
    def initialize_state(self, imbalanced_threshold: int = DEFAULT_IMBALANCED_THRESHOLD,
                         min_match_tokens: int = DEFAULT_MIN_MATCH_TOKENS, **kwargs: Any) -> None:
        if imbalanced_threshold < 0:
            raise ValueError(f"imbalanced_threshold: must be >= 0, got {imbalanced_threshold}")
        if min_match_tokens < 1:
            raise ValueError(f"min_match_tokens: must be >= 1, got {min_match_tokens}")
        self._register()
        self.imbalanced_threshold = imbalanced_threshold
        self.min_match_tokens = min_match_tokens
        self._in_flight: collections.Counter[ReplicaID] = collections.Counter()
        # replica -> {internal request id: [prompt block hashes, digest seq at its end or None]}
        self._recent: dict[ReplicaID, dict[str, list]] = collections.defaultdict(dict)
        self._where: dict[str, ReplicaID] = {}  # internal request id -> replica, while in flight

    # ------------------------------------------------------------------ decisions
    def _load(self, r: RunningReplica) -> int:
        return self._in_flight[r.replica_id]

    def _expire(self, r: RunningReplica) -> None:
        """Drop the routed requests whose blocks ``r``'s digests now tell (or no longer hold): those
        that ended two digests ago."""
        recent = self._recent.get(r.replica_id)
        if recent:
            seq = r.routing_stats.get("seq", 0)
            for rid in [rid for rid, (_, end_seq) in recent.items() if end_seq is not None and seq >= end_seq + 2]:
                del recent[rid]

    def _match(self, r: RunningReplica, hashes: list[int]) -> PrefixMatch:
        best = match_digest(hashes, r.routing_stats.get("digest") or {})
        for h, _ in self._recent.get(r.replica_id, {}).values():  # routed here, not yet in a digest
            n = 0
            while n < len(h) and n < len(hashes) and h[n] == hashes[n]:
                n += 1
            if n > best.num_blocks:
                best = PrefixMatch(n, n)
        return best

    def choose(self, candidates: list[RunningReplica], req: ReplicaRequest) -> tuple[RunningReplica, str, int]:
        """(replica, reason, matched tokens) for one request: the routing decision, no I/O."""
        block_size = _block_size(candidates)
        hashes = prompt_block_hashes(req.prompt_token_ids, block_size)
        least = min(self._load(r) for r in candidates)
        for r in candidates:
            self._expire(r)
        matches = [self._match(r, hashes) for r in candidates]
        i = max(range(len(candidates)), key=lambda i: (matches[i].num_blocks, matches[i].num_device_blocks,
                                                         -self._load(candidates[i])))
        if matches[i].num_blocks and matches[i].num_blocks * block_size >= self.min_match_tokens:
            if self._load(candidates[i]) - least <= self.imbalanced_threshold:
                return candidates[i], "prefix", matches[i].num_blocks * block_size
            reason = "imbalanced"
        else:
            reason = "no_match"
        j = min(range(len(candidates)), key=lambda j: (self._load(candidates[j]),
                                                       len(candidates[j].routing_stats.get("digest") or ())))
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
    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        req = _request_of(pending_request)
        if req is None:
            return
        rid = pending_request.metadata.internal_request_id
        self._in_flight[replica_id] += 1
        self._where[rid] = replica_id
        block_size = _block_size(list(self.curr_replicas.values()))
        self._recent[replica_id][rid] = [prompt_block_hashes(req.prompt_token_ids, block_size), None]

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._where.pop(internal_request_id, None) is None:
            return
        self._in_flight[replica_id] -= 1
        if self._in_flight[replica_id] <= 0:
            del self._in_flight[replica_id]
        entry = self._recent.get(replica_id, {}).get(internal_request_id)
        if entry is not None:
            r = self.curr_replicas.get(replica_id)
            entry[1] = r.routing_stats.get("seq", 0) if r is not None else 0

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        alive = {r.replica_id for r in replicas}
        for gone in [rid for rid in self._recent if rid not in alive]:  # a dead replica's state goes
            del self._recent[gone]
            self._in_flight.pop(gone, None)
        for rid, where in list(self._where.items()):
            if where not in alive:
                del self._where[rid]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._recent.pop(replica_id, None)
        self._in_flight.pop(replica_id, None)

