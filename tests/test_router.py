"""The routers' decisions and the cache digests and loads they read, without a Ray cluster: a
router object is built without Serve's machinery and given fake replicas with routing stats."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections import Counter
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")

from ray.serve._private.common import DeploymentID, ReplicaID  # noqa: E402

from prefixkv.kv import KVCacheCoordinator, TierConnector  # noqa: E402
from prefixkv.kv.tiers import TIER_DEVICE, TIER_DISK, TIER_HOST  # noqa: E402
from prefixkv.kv.radix import block_hash  # noqa: E402
from prefixkv.sampling_params import SamplingParams  # noqa: E402
from prefixkv.serve import registry  # noqa: E402
from prefixkv.serve.digest import match_digest, prompt_block_hashes  # noqa: E402
from prefixkv.serve.replica import ReplicaRequest  # noqa: E402
from prefixkv.serve.router import CacheAwareRouter, CacheThresholdRouter, Estimate, routing_keys  # noqa: E402

BS = 4
DEP = DeploymentID(name="EngineReplica", app_name="test-router")


def replica(name: str, digest: dict[int, int] | None = None, seq: int = 1, load: dict | None = None,
            block_size: int = BS):
    return SimpleNamespace(replica_id=ReplicaID(unique_id=name, deployment_id=DEP),
                           routing_stats={"block_size": block_size, "digest": digest or {}, "seq": seq,
                                          "load": load},
                           max_ongoing_requests=100)


def load(t: float, running: int = 0, waiting: int = 0, prefill: int = 0, rate: float | None = 1000.0,
         step: float | None = 0.05) -> dict:
    """A replica's published load (serve/load.py), reported at time ``t``."""
    return {"time": t, "num_running": running, "num_waiting": waiting, "num_prefill_tokens": prefill,
            "prefill_tokens_per_s": rate, "decode_step_s": step}


def router(cls=CacheThresholdRouter, **kwargs):
    r = object.__new__(cls)  # Serve's constructor wants a running controller
    r._deployment_id = DEP
    r._replicas, r._replica_id_set, r._queue_len_gauge_last_update = {}, set(), {}
    r._colocated_replica_ids, r._multiplexed_model_id_to_replica_ids = {}, {}  # the mixins' indices
    r.initialize_state(**kwargs)
    return r


def cost_router(*replicas, **kwargs) -> CacheAwareRouter:
    r = router(CacheAwareRouter, **kwargs)
    r._replicas = {x.replica_id: x for x in replicas}
    return r


def request(ids: list[int], rid: str = "r") -> ReplicaRequest:
    return ReplicaRequest(rid, ids, SamplingParams(max_tokens=1))


def digest_of(ids: list[int], tier: int = TIER_DEVICE) -> dict[int, int]:
    return dict.fromkeys(prompt_block_hashes(ids, BS), tier)


def pending(req: ReplicaRequest, internal_id: str):
    return SimpleNamespace(args=[req], kwargs={}, metadata=SimpleNamespace(internal_request_id=internal_id),
                           future=concurrent.futures.Future())


def route(r, candidates: list, req: ReplicaRequest, internal_id: str):
    """One routing decision as Serve asks for it (``choose_replicas``); returns the pending
    request and the ranks."""
    p = pending(req, internal_id)
    return p, asyncio.run(r.choose_replicas(candidates, p))


P = list(range(10, 30))  # 5 blocks


def test_prompt_block_hashes_are_the_radix_index_chain_and_skip_the_last_token():
    assert prompt_block_hashes(P[:8], BS) == [block_hash(0, P[:4])]  # the block of the last token: never
    assert prompt_block_hashes(P[:9], BS) == [block_hash(0, P[:4]), block_hash(block_hash(0, P[:4]), P[4:8])]
    assert prompt_block_hashes(P[:1], BS) == []


def test_cache_digest_lists_every_cached_block_with_its_highest_tier():
    kv = KVCacheCoordinator(num_blocks=8, block_size=BS, lower=TierConnector(num_host_pages=4))
    assert kv.allocate_slots("a", 0, 12) == []
    kv.cache_blocks("a", P[:12], 12)
    kv.free("a")
    hashes = prompt_block_hashes(P[:13], BS)
    assert kv.cache_digest() == dict.fromkeys(hashes, TIER_DEVICE)
    kv.evict(1)  # the tail block leaves the device for the host tier
    d = kv.cache_digest()
    assert d == {hashes[0]: TIER_DEVICE, hashes[1]: TIER_DEVICE, hashes[2]: TIER_HOST}
    assert match_digest(prompt_block_hashes(P, BS), d) == (3, 2)
    assert match_digest(prompt_block_hashes([1] + P, BS), d) == (0, 0)
    assert TIER_DISK == 2


def test_the_longest_cached_prefix_wins_and_device_blocks_break_ties():
    r = router()
    a, b, c = replica("a", digest_of(P[:9])), replica("b", digest_of(P[:17])), replica("c")
    assert r.choose([a, b, c], request(P)) == (b, "prefix", 16)
    b2 = replica("b", digest_of(P[:9], TIER_HOST))
    assert r.choose([b2, a, c], request(P)) == (a, "prefix", 8)  # same length: the device copy


def test_no_match_goes_to_the_least_loaded_then_the_one_caching_less():
    r = router()
    a, b = replica("a", digest_of(list(range(100, 140)))), replica("b", digest_of(list(range(200, 210))))
    assert r.choose([a, b], request(P)) == (b, "no_match", 0)
    r._in_flight[b.replica_id] = 1
    assert r.choose([a, b], request(P)) == (a, "no_match", 0)


def test_imbalance_overrides_the_prefix_and_min_match_tokens_ignores_short_ones():
    r = router(imbalanced_threshold=2)
    a, b = replica("a", digest_of(P)), replica("b")
    r._in_flight[a.replica_id] = 2
    assert r.choose([a, b], request(P))[:2] == (a, "prefix")
    r._in_flight[a.replica_id] = 3
    assert r.choose([a, b], request(P)) == (b, "imbalanced", 0)
    r2 = router(min_match_tokens=12)
    short = replica("a", digest_of(P[:9]))
    assert r2.choose([short, b], request(P)) == (b, "no_match", 0)
    with pytest.raises(ValueError, match="imbalanced_threshold"):
        router(imbalanced_threshold=-1)
    with pytest.raises(ValueError, match="min_match_tokens"):
        router(min_match_tokens=0)


def test_a_routed_request_counts_as_cached_until_two_digests_after_it_ended():
    r = router()
    a, b = replica("a", seq=5), replica("b", seq=5)
    r._replicas = {a.replica_id: a, b.replica_id: b}
    r.on_request_routed(pending(request(P), "i1"), a.replica_id, None)
    assert r._in_flight[a.replica_id] == 1
    # a follower of the same prefix, before any digest has it: where the first one went, although a is busier
    assert r.choose([b, a], request(P[:13] + [99]))[:2] == (a, "prefix")
    r.on_request_completed(a.replica_id, "i1")
    assert r._in_flight[a.replica_id] == 0
    a.routing_stats = {**a.routing_stats, "seq": 6}
    assert r.choose([b, a], request(P))[:2] == (a, "prefix")  # one digest since: maybe computed before the end
    a.routing_stats = {**a.routing_stats, "seq": 7}  # two digests, and they do not hold P: a evicted it
    assert r.choose([b, a], request(P))[1] == "no_match"
    assert r._recent[a.replica_id] == {}


def test_a_dead_replica_leaves_no_state_and_routers_register_by_deployment():
    r = router()
    a = replica("a")
    r._replicas = {a.replica_id: a}
    r.on_request_routed(pending(request(P), "i1"), a.replica_id, None)
    r.on_replica_actor_died(a.replica_id)
    assert a.replica_id not in r._recent and a.replica_id not in r._in_flight
    assert r in registry.routers_for("EngineReplica")
    assert r.routed[a.replica_id.unique_id] == 1


def test_a_cache_summary_trims_breadth_first():
    from prefixkv.server.cache_view import trim_tree

    def node(name, *children):
        return {"name": name, "children": list(children)}

    tree = {"num_nodes": 6, "num_shown_nodes": 5,
            "root": {"num_children": 2, "children": [node("a", node("a1"), node("a2")), node("b", node("b1"))]}}
    cut = trim_tree(tree, 3)
    assert cut["num_shown_nodes"] == 3 and cut["num_nodes"] == 6
    assert [(c["name"], [g["name"] for g in c["children"]]) for c in cut["root"]["children"]] == [
        ("a", ["a1"]), ("b", [])]
    assert trim_tree(tree, 64)["root"] == tree["root"]


def test_rays_routers_are_selectable_with_the_same_bookkeeping():
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter
    from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter

    from prefixkv.serve.app import ROUTERS
    from prefixkv.serve import router as routers

    assert ROUTERS == {"cache_aware": "CacheAwareRouter", "cache_threshold": "CacheThresholdRouter",
                       "power_of_two": "PowerOfTwoRouter", "prefix_affinity": "PrefixAffinityRouter"}
    assert issubclass(routers.PowerOfTwoRouter, PowerOfTwoChoicesRequestRouter)
    assert issubclass(routers.PrefixAffinityRouter, PrefixCacheAffinityRouter)
    # their own choose_replicas runs, counted (on_request_routed chains to Ray's: its tree insert)
    assert routers.PrefixAffinityRouter.on_request_routed is routers._Observed.on_request_routed
    assert (routers.PowerOfTwoRouter.decision, routers.PrefixAffinityRouter.decision) == (
        "power_of_two", "prefix_affinity")
    assert request(P).prompt == "".join(map(chr, P))  # what Ray's prefix tree matches: one char per token


# ---------------------------------------------------------------------- the cost model (CacheAwareRouter)
def _unrelated(i: int, n: int = 30) -> ReplicaRequest:
    return request(list(range(1000 + 100 * i, 1000 + 100 * i + n)))


@pytest.mark.parametrize("published", [True, False])
def test_a_simultaneous_burst_of_unrelated_requests_spreads_evenly(published):
    """Nothing cached anywhere, every decision before any request reached a replica: each counts
    against its replica from the decision, so the next one sees it (idle reports, or none yet)."""
    now = time.time()
    reps = [replica(n, load=load(now - 0.5) if published else None) for n in "abc"]
    r = cost_router(*reps)
    ranks = [route(r, reps, _unrelated(i), f"i{i}")[1] for i in range(12)]
    assert r.in_flight() == {"a": 4, "b": 4, "c": 4}
    assert r.decisions == {"no_match": 12}
    assert [x[0][0].replica_id.unique_id for x in ranks[:3]] == ["a", "b", "c"]
    # the others are the fallbacks, the fastest first
    assert [x.replica_id.unique_id for x in ranks[3][1]] == ["b", "c"]


def test_a_long_shared_prefix_draws_its_requests_until_the_queue_makes_another_faster():
    now = time.time()
    prefix = list(range(1000, 1400))  # 100 blocks cached on a
    a = replica("a", digest_of(prefix + [0]), load=load(now - 0.5))
    b = replica("b", load=load(now - 0.5))
    r = cost_router(a, b)
    where = []
    for k in range(7):  # cost on a: (8k + 8) / 1000 + 0.05 k + 8k / 1000, on b: 408 / 1000
        p, ranks = route(r, [a, b], request(prefix + [k] * 8), f"i{k}")
        where.append(ranks[0][0].replica_id.unique_id)
    assert where == ["a"] * 7 and r.decisions == {"prefix": 7}
    d = r.choose([a, b], request(prefix + [7] * 8))
    ttft = 64 / 1000 + 7 * 0.05  # 7 requests, 56 tokens ahead, 8 of its own
    assert [tuple(e) for e in d.estimates] == [
        pytest.approx((ttft + 7 * 8 / 1000, ttft, 400, 7, 56, 1000.0, 0.05)),
        pytest.approx((408 / 1000, 408 / 1000, 0, 0, 0, 1000.0, 0.05))]
    assert (d.replica, d.reason) == (b, "queue")  # a's queue now costs more than the prefix saves
    # a's requests end: the prefix draws again
    for k in range(7):
        pk = pending(request(prefix + [k] * 8), f"i{k}")
        r.on_request_routed(pk, a.replica_id, None)
        r.on_request_completed(a.replica_id, f"i{k}")
    assert r.in_flight() == {}
    assert r.choose([a, b], request(prefix + [7] * 8))[:2] == (a, "prefix")


def test_a_short_template_prefix_does_not_unbalance_a_burst():
    now = time.time()
    template = list(range(500, 532))  # 2 blocks of 16, cached on a
    a = replica("a", dict.fromkeys(prompt_block_hashes(template + [0], 16), TIER_DEVICE),
                load=load(now - 0.5), block_size=16)
    b = replica("b", load=load(now - 0.5), block_size=16)
    burst = [request(template + list(range(2000 + 40 * i, 2040 + 40 * i))) for i in range(8)]
    r = cost_router(a, b)
    chosen = [route(r, [a, b], q, f"i{i}")[1][0][0].replica_id.unique_id for i, q in enumerate(burst)]
    assert Counter(chosen) == {"a": 4, "b": 4}
    # the rule before the cost model (--router cache_threshold) put the whole burst on a
    old = router(CacheThresholdRouter)
    old._replicas = {a.replica_id: a, b.replica_id: b}
    for i, q in enumerate(burst):
        rep = old.choose([a, b], q)[0]
        old.on_request_routed(pending(q, f"i{i}"), rep.replica_id, None)
    assert old.in_flight() == {"a": 8}


def test_a_template_prefix_does_not_win_over_an_idle_replica():
    now = time.time()
    template = list(range(500, 532))
    q = request(template + list(range(2000, 2040)))  # 72 tokens, 32 of them cached on a
    digest = dict.fromkeys(prompt_block_hashes(template + [0], 16), TIER_DEVICE)
    busy = replica("a", digest, load=load(now - 0.5, running=1), block_size=16)  # one request decoding
    idle = replica("b", load=load(now - 0.5), block_size=16)
    d = cost_router(busy, idle).choose([busy, idle], q)
    assert (d.replica, d.reason) == (idle, "queue")  # 40 / 1000 + 0.05 + 40 / 1000 > 72 / 1000
    assert d.estimates[0].ttft_s == pytest.approx(40 / 1000 + 0.05)
    # no threshold: holding 64 of its 72 tokens, the busy replica wins (8 / 1000 + 0.05 + 8 / 1000)
    longer = dict.fromkeys(prompt_block_hashes(list(range(500, 564)) + [0], 16), TIER_DEVICE)
    busy = replica("a", longer, load=load(now - 0.5, running=1), block_size=16)
    d = cost_router(busy, idle).choose([busy, idle], request(list(range(500, 564)) + list(range(2000, 2008))))
    assert (d.replica, d.reason) == (busy, "prefix") and d.estimates[0].cost_s == pytest.approx(0.066)


def test_a_report_replaces_the_reservations_it_counts():
    t0 = time.time() - 1
    a = replica("a", load=load(t0))
    r = cost_router(a)
    for i in range(3):
        p, _ = route(r, [a], _unrelated(i), f"i{i}")
        r.on_request_routed(p, a.replica_id, None)
    assert r._queue(a) == (3, 90)  # routed since a's report: counted by the router
    a.routing_stats["load"] = load(time.time(), running=3, prefill=20)  # a's report now has them
    assert r._queue(a) == (3, 20)
    r.on_request_completed(a.replica_id, "i0")
    assert r._queue(a) == (2, 20) and r.in_flight() == {"a": 2}  # ended since the report
    a.routing_stats["load"] = load(time.time(), running=2)
    assert r._queue(a) == (2, 0) and r._ended_at[a.replica_id] == []
    # requests the router did not send (another ingress's) come from the report alone
    a.routing_stats["load"] = load(time.time(), running=2, waiting=5, prefill=300)
    assert r._queue(a) == (7, 300)


def test_a_report_that_missed_requests_in_transit_counts_them_still():
    a, b = replica("a", load=load(time.time() - 1)), replica("b", load=load(time.time() - 1))
    r = cost_router(a, b)
    for i in range(4):
        route(r, [a, b], _unrelated(i), f"i{i}")
    assert r.in_flight() == {"a": 2, "b": 2}
    # a reports after all four were routed, but its two had not reached it yet: an empty queue
    a.routing_stats["load"] = load(time.time(), running=0)
    assert r._queue(a)[0] == 2  # this router's two requests there, not ended: still counted
    route(r, [a, b], _unrelated(9), "i9")
    assert r.in_flight() in ({"a": 3, "b": 2}, {"a": 2, "b": 3})  # no pile-up on the "empty" replica
    r.on_request_completed(a.replica_id, "i0")
    assert r._queue(a)[0] == len(r._by_replica[a.replica_id])


def test_reservations_are_released_on_refusal_failure_cancellation_and_replica_death():
    now = time.time()
    a, b = replica("a", load=load(now - 0.5)), replica("b", load=load(now - 0.5))
    r = cost_router(a, b)
    q1 = request(P + [1])
    p1, ranks = route(r, [a, b], q1, "i1")
    assert ranks[0] == [a] and r.in_flight() == {"a": 1}
    r.on_request_completed(a.replica_id, "i1")  # a refused it (max_ongoing_requests): Serve calls this
    held = lambda: [e.num_held_tokens for e in r.choose([a, b], request(P + [2])).estimates]  # noqa: E731
    assert r.in_flight() == {} and held() == [0, 0]  # not even its prompt counts as cached there
    p1, _ = route(r, [a, b], q1, "i1")  # Serve routes it again; the fallback b takes it
    r.on_request_routed(p1, b.replica_id, None)
    assert r.in_flight() == {"b": 1} and held() == [0, 20]
    r.on_request_completed(a.replica_id, "i1")  # (a late word from a: not its request any more)
    assert r.in_flight() == {"b": 1}
    r.on_request_completed(b.replica_id, "i1")  # its stream ended, in success or failure
    assert r.in_flight() == {}
    p3, _ = route(r, [a, b], _unrelated(3), "i3")
    assert r.in_flight() == {"a": 1}
    p3.future.cancel()  # the client went away before it was routed
    route(r, [a, b], _unrelated(4), "i4")  # (the next decision drops it)
    assert r.in_flight() == {"a": 1} and "i3" not in r._reserved
    p5, _ = route(r, [a, b], _unrelated(5), "i5")
    r.on_request_routed(p5, b.replica_id, None)
    assert r.in_flight() == {"a": 1, "b": 1}
    r.on_replica_actor_died(a.replica_id)
    assert r.in_flight() == {"b": 1} and set(r._reserved) == {"i5"} and a.replica_id not in r._recent


def test_replicas_are_weighed_at_the_median_of_the_measured_speeds_or_at_their_own():
    now = time.time()
    a = replica("a", load=load(now, rate=2000.0, step=0.02))
    a2 = replica("a2", load=load(now, rate=3000.0, step=0.04))
    a3 = replica("a3", load=load(now, rate=1000.0, step=0.03))
    b = replica("b", load=load(now, rate=None, step=None))  # just started
    c = replica("c")  # no load published yet
    speeds = lambda r, reps: [(e.prefill_tokens_per_s, e.decode_step_s)  # noqa: E731
                              for e in r.choose(reps, _unrelated(0)).estimates]
    assert speeds(cost_router(a, a2, a3, b, c), [a, a2, a3, b, c]) == [(2000.0, 0.03)] * 5
    assert speeds(cost_router(a, a2, a3, b, c, speeds="replica"), [a, a2, a3, b, c]) == [
        (2000.0, 0.02), (3000.0, 0.04), (1000.0, 0.03), (2000.0, 0.03), (2000.0, 0.03)]
    assert speeds(cost_router(b, c, default_prefill_tokens_per_s=500.0, default_decode_step_s=0.1), [b, c]) == [
        (500.0, 0.1)] * 2
    # a faster replica gets more of a burst when weighed at its own speed
    fast, slow = replica("f", load=load(now - 1, rate=4000.0)), replica("s", load=load(now - 1, rate=1000.0))
    r = cost_router(fast, slow, speeds="replica")
    for i in range(10):
        route(r, [fast, slow], _unrelated(i, 200), f"i{i}")
    assert r.in_flight() == {"f": 7, "s": 3}
    with pytest.raises(ValueError, match="default_prefill_tokens_per_s"):
        router(CacheAwareRouter, default_prefill_tokens_per_s=0)
    with pytest.raises(ValueError, match="speeds: must be one of deployment, replica"):
        router(CacheAwareRouter, speeds="node")
    assert routing_keys(request(P), BS) == prompt_block_hashes(P, BS)


def test_router_flags_belong_to_their_router():
    import argparse

    from prefixkv.serve.app import add_ray_args, router_kwargs_from_args

    p = argparse.ArgumentParser()
    add_ray_args(p)
    assert router_kwargs_from_args(p.parse_args([])) == {}
    assert router_kwargs_from_args(p.parse_args(["--router", "cache_threshold", "--router-imbalanced-threshold",
                                                 "8"])) == {"imbalanced_threshold": 8}
    with pytest.raises(ValueError, match="--router-min-match-tokens: applies to --router cache_threshold only"):
        router_kwargs_from_args(p.parse_args(["--router-min-match-tokens", "32"]))
    assert router_kwargs_from_args(p.parse_args(["--router-speeds", "replica"])) == {"speeds": "replica"}
    with pytest.raises(ValueError, match="--router-speeds: applies to --router cache_aware only"):
        router_kwargs_from_args(p.parse_args(["--router", "power_of_two", "--router-speeds", "replica"]))
