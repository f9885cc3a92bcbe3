"""The cache-aware router's decisions and the cache digests it reads, without a Ray cluster: the
router object is built without Serve's machinery and given replicas with routing stats."""

from __future__ import annotations

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
from prefixkv.serve.router import CacheAwareRouter  # noqa: E402

BS = 4
DEP = DeploymentID(name="EngineReplica", app_name="test-router")


def replica(name: str, digest: dict[int, int] | None = None, seq: int = 1):
    return SimpleNamespace(replica_id=ReplicaID(unique_id=name, deployment_id=DEP),
                           routing_stats={"block_size": BS, "digest": digest or {}, "seq": seq},
                           max_ongoing_requests=100)


def router(**kwargs) -> CacheAwareRouter:
    r = object.__new__(CacheAwareRouter)  # Serve's constructor wants a running controller
    r._deployment_id = DEP
    r._replicas, r._replica_id_set, r._queue_len_gauge_last_update = {}, set(), {}
    r._colocated_replica_ids, r._multiplexed_model_id_to_replica_ids = {}, {}  # the mixins' indices
    r.initialize_state(**kwargs)
    return r


def request(ids: list[int], rid: str = "r") -> ReplicaRequest:
    return ReplicaRequest(rid, ids, SamplingParams(max_tokens=1))


def digest_of(ids: list[int], tier: int = TIER_DEVICE) -> dict[int, int]:
    return dict.fromkeys(prompt_block_hashes(ids, BS), tier)


def pending(req: ReplicaRequest, internal_id: str):
    return SimpleNamespace(args=[req], kwargs={}, metadata=SimpleNamespace(internal_request_id=internal_id))


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

    assert ROUTERS == {"cache_aware": "CacheAwareRouter", "power_of_two": "PowerOfTwoRouter",
                       "prefix_affinity": "PrefixAffinityRouter"}
    assert issubclass(routers.PowerOfTwoRouter, PowerOfTwoChoicesRequestRouter)
    assert issubclass(routers.PrefixAffinityRouter, PrefixCacheAffinityRouter)
    # their own choose_replicas runs, counted (on_request_routed chains to Ray's: its tree insert)
    assert routers.PrefixAffinityRouter.on_request_routed is routers._Observed.on_request_routed
    assert (routers.PowerOfTwoRouter.decision, routers.PrefixAffinityRouter.decision) == (
        "power_of_two", "prefix_affinity")
    assert request(P).prompt == "".join(map(chr, P))  # what Ray's prefix tree matches: one char per token
