"""The routers' event-fed cache view (``cache_view="events"``, serve/block_view.py and
serve/kv_subscriber.py) and retained prefixes counted as held, without a Ray cluster: the events
come from a real KV cache (``KVCacheCoordinator`` with a ``KVEventLog``) through a real publisher
(kv_events.ZmqEventPublisher) on loopback TCP, the router is built as in tests/test_router.py."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("ray.serve")
msgspec = pytest.importorskip("msgspec")
pytest.importorskip("zmq")

from prefixkv import kv_events  # noqa: E402
from prefixkv.config import KVEventsConfig  # noqa: E402
from prefixkv.kv import KVCacheCoordinator, TierConnector  # noqa: E402
from prefixkv.kv.events import KVEventLog  # noqa: E402
from prefixkv.kv.hashing import U64, BlockHasher  # noqa: E402
from prefixkv.kv.keys import cache_root  # noqa: E402
from prefixkv.kv.tiers import TIER_DEVICE, TIER_HOST  # noqa: E402
from prefixkv.sampling_params import SamplingParams  # noqa: E402
from prefixkv.serve.block_view import BlockView  # noqa: E402
from prefixkv.serve.digest import bounded_digest, prompt_block_hashes  # noqa: E402
from prefixkv.serve.kv_subscriber import EventSubscriber  # noqa: E402
from prefixkv.serve.replica import ReplicaRequest  # noqa: E402
from prefixkv.serve.router import CacheAwareRouter, CacheThresholdRouter, routing_keys  # noqa: E402
from test_router import BS, P, cost_router, replica, request, route, router  # noqa: E402

W = kv_events.wire_schema()
DECODE = msgspec.msgpack.Decoder(W.KVEventBatch).decode


def batch(*events, ts: float = 1.0):
    return W.KVEventBatch(ts=ts, events=list(events))


def stored(hashes, medium="GPU"):
    return W.BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[0] * BS * len(hashes),
                         block_size=BS, lora_id=None, medium=medium, lora_name=None)


def removed(hashes, medium="GPU"):
    return W.BlockRemoved(block_hashes=list(hashes), medium=medium)


def wait_for(cond, what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_view_follows_stored_removed_and_cleared_per_medium_in_sequence():
    v = BlockView()
    assert not v.synced
    assert v.apply(0, batch(stored([1, 2, 3]), stored([3], "CPU")))
    assert v.synced and v.match([1, 2, 3, 4]) == (3, 3)
    assert v.apply(1, batch(removed([3])))  # the host's copy stays held
    assert v.match([1, 2, 3]) == (3, 2) and v.held["GPU"] == {1, 2} and v.held["CPU"] == {3}
    assert v.apply(1, batch(W.AllBlocksCleared()))  # applied already: skipped
    assert v.match([1, 2, 3]) == (3, 2)
    assert not v.apply(3, batch(W.AllBlocksCleared()))  # 2 is missing: a gap, nothing changed
    assert v.match([1, 2, 3]) == (3, 2) and v.next_seq == 2
    assert v.apply(2, batch(removed([3], "CPU"), stored([9], "STORAGE")))
    assert v.match([1, 2, 3]) == (2, 2) and v.num_blocks == 3
    assert v.apply(3, batch(W.AllBlocksCleared(), stored([1])))
    assert v.match([1, 2]) == (1, 1) and v.num_blocks == 1


def test_a_lost_gap_restarts_the_view_until_a_later_digest_is_folded_in():
    v = BlockView()
    assert v.apply(0, batch(stored([1, 2])))
    v.lost(5)
    assert not v.synced and v.num_blocks == 0 and v.num_lost == 1
    assert v.apply(5, batch(stored([7]), removed([2])))
    before = v.lost_at - 1.0
    assert not v.fold_digest({1: TIER_DEVICE, 2: TIER_DEVICE}, before, lambda h: h)  # older than the loss
    # the digest's blocks join, in its tiers' media, except the one an event removed since the loss
    assert v.fold_digest({1: TIER_DEVICE, 2: TIER_DEVICE, 3: TIER_HOST}, time.time() + 1, lambda h: h)
    assert v.synced and v.held["GPU"] == {1, 7} and v.held["CPU"] == {3}


def _events_of(kv: KVCacheCoordinator) -> list:
    return DECODE(msgspec.msgpack.encode(kv_events.to_wire(1.0, kv.events.take()))).events


def test_the_view_reproduces_what_a_cache_holds_in_every_tier():
    hasher = BlockHasher.create("builtin", None)
    kv = KVCacheCoordinator(num_blocks=8, block_size=BS, lower=TierConnector(num_host_pages=4),
                            events=KVEventLog(hasher, BS))
    v = BlockView()
    seq = 0

    def sync():
        nonlocal seq
        assert v.apply(seq, W.KVEventBatch(ts=float(seq), events=_events_of(kv)))
        seq += 1
        digest = kv.cache_digest()
        held = set().union(*v.held.values())
        assert held == {h & U64 for h in digest}, (v.held, digest)
        assert v.held["GPU"] == {h & U64 for h, t in digest.items() if t == TIER_DEVICE}

    assert kv.allocate_slots("a", 0, 12) == []
    kv.cache_blocks("a", P[:12], 12)
    kv.free("a")
    sync()
    assert v.match([h & U64 for h in prompt_block_hashes(P, BS)]) == (3, 3)
    kv.evict(2)  # two blocks leave the device for the host tier
    sync()
    assert v.held["CPU"] and v.match([h & U64 for h in prompt_block_hashes(P, BS)]) == (3, 1)


def publisher(**kw) -> kv_events.ZmqEventPublisher:
    return kv_events.ZmqEventPublisher(KVEventsConfig(
        enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", **kw))


def test_a_late_subscriber_replays_what_it_missed_and_a_hole_past_the_buffer_is_lost():
    full, short = publisher(), publisher(buffer_steps=2)
    sub = EventSubscriber()
    try:
        for pub in (full, short):
            for i in range(5):
                assert pub.publish([kv_events.ev.BlockStored((i,), None, (0,) * BS, BS, "GPU", (None,))])
        time.sleep(0.2)  # sent before anyone listened
        a = sub.watch("a", full.endpoint, full.replay_endpoint)
        b = sub.watch("b", short.endpoint, short.replay_endpoint)
        wait_for(lambda: a.next_seq == 5 and b.next_seq == 5, "the replays")
        assert a.synced and a.held["GPU"] == {0, 1, 2, 3, 4}
        assert not b.synced and b.num_lost == 1 and b.held["GPU"] == {3, 4}  # 0-2 left the buffer
        full.publish([kv_events.ev.BlockRemoved((0,), "GPU")])
        wait_for(lambda: a.next_seq == 6, "the next batch")
        assert a.held["GPU"] == {1, 2, 3, 4}
    finally:
        sub.close()
        full.shutdown()
        short.shutdown()


def test_a_gap_in_the_stream_is_filled_from_the_replay_socket():
    pub = publisher()
    sub = EventSubscriber()
    sub._open()
    try:
        frames = []
        got = pub._buffer
        for i in range(3):
            pub.publish([kv_events.ev.BlockStored((i,), None, (0,) * BS, BS, "GPU", (None,))])
            wait_for(lambda: len(got) == i + 1, "the batch sent")
            seq, payload = got[-1]
            frames.append([b"", seq.to_bytes(8, "big"), payload])
        v = BlockView()
        w = (pub.endpoint, pub.replay_endpoint, "")
        sub._deliver(w, v, frames[0])
        sub._deliver(w, v, frames[2])  # 1 did not arrive: replayed
        assert v.next_seq == 3 and v.synced and v.held["GPU"] == {0, 1, 2} and v.num_lost == 0
        v2 = BlockView()
        sub._deliver((pub.endpoint, None, ""), v2, frames[0])
        sub._deliver((pub.endpoint, None, ""), v2, frames[2])  # no replay socket: lost
        assert v2.num_lost == 1 and not v2.synced and v2.held["GPU"] == {2}
    finally:
        sub._ctx.term()
        pub.shutdown()


class EventReplica:
    """A fake replica whose KV cache is real and whose events go out on a real publisher."""

    def __init__(self, name: str, algo: str = "builtin") -> None:
        self.hasher = BlockHasher.create(algo, "0")
        self.kv = KVCacheCoordinator(num_blocks=32, block_size=BS, events=KVEventLog(self.hasher, BS))
        self.pub = publisher()
        self.r = replica(name)
        self.r.routing_stats.update(time=time.time(), kv_events={
            "endpoint": self.pub.endpoint, "replay_endpoint": self.pub.replay_endpoint, "topic": "",
            "hash_algo": algo, "hash_root": self.hasher.root.hex() if isinstance(self.hasher.root, bytes) else None})
        self.num_batches = 0

    def cache(self, ids: list[int], salt: str | None = None, partition: str | None = None) -> None:
        seq = f"s{self.num_batches}"
        assert self.kv.allocate_slots(seq, 0, len(ids)) == []
        self.kv.cache_blocks(seq, ids, len(ids), root=cache_root(salt, partition), cache_salt=salt,
                             partition=partition)
        self.kv.free(seq)
        assert self.pub.publish(self.kv.events.take())
        self.num_batches += 1

    def close(self) -> None:
        self.pub.shutdown()


@pytest.fixture
def fleet():
    made = []

    def make(*names, algo="builtin"):
        made.extend(EventReplica(n, algo) for n in names)
        return made[-len(names):]

    yield make
    for x in made:
        x.close()


def _synced(r, *replicas) -> None:
    """Wait until the router's views have every batch the replicas published."""
    for x in replicas:
        r._events_of(x.r)
    wait_for(lambda: all(r._subscriber.view(x.r.replica_id.unique_id).next_seq == x.num_batches
                         for x in replicas), "the router's views")


def salted(ids: list[int], salt: str | None, rid: str = "r") -> ReplicaRequest:
    return ReplicaRequest(rid, ids, SamplingParams(max_tokens=1, cache_salt=salt))


@pytest.mark.parametrize("algo", ["builtin", "sha256_cbor"])
def test_the_router_follows_a_prefix_to_the_replica_whose_events_show_it(fleet, algo):
    a, b = fleet("a", "b", algo=algo)  # their digests are empty: only the events tell
    r = cost_router(a.r, b.r, cache_view="events")
    try:
        b.cache(P[:17])
        a.cache(list(range(100, 120)))
        _synced(r, a, b)
        d = r.choose([a.r, b.r], request(P))
        assert d.replica is b.r and d.reason == "prefix" and d.estimates[1].num_held_tokens == 16
        assert r.cache_views()["b"] == {"synced": True, "num_blocks": 4, "num_batches": 1, "num_lost": 0}
        t = router(CacheThresholdRouter, cache_view="events")
        t._replicas = {x.r.replica_id: x.r for x in (a, b)}
        try:
            _synced(t, a, b)
            assert t.choose([a.r, b.r], request(P)) == (b.r, "prefix", 16)
        finally:
            t._subscriber.close()
    finally:
        r._subscriber.close()


def test_salted_keys_match_only_the_same_salt_in_the_events(fleet):
    a, b = fleet("a", "b")
    r = cost_router(a.r, b.r, cache_view="events")
    try:
        a.cache(P, salt="tenant-1")
        b.cache(P, salt="tenant-2")
        _synced(r, a, b)
        for salt, where in (("tenant-1", a), ("tenant-2", b)):
            d = r.choose([a.r, b.r], salted(P, salt))
            assert d.replica is where.r and d.reason == "prefix" and max(e.num_held_tokens for e in d.estimates) == 16
        assert r.choose([a.r, b.r], salted(P, None)).reason == "no_match"
        assert r.choose([a.r, b.r], salted(P, "tenant-3")).reason == "no_match"
        # a partition is in the hash, never in the event: its requests match only their partition's blocks
        a.cache(P[:9], partition="k1")
        _synced(r, a)
        req = request(P)
        req.params.cache_partition = "k1"
        assert r.choose([a.r, b.r], req).estimates[0].num_held_tokens == 8
        assert r.choose([a.r, b.r], request(P)).reason == "no_match"
        r._watch([a.r])  # b is gone: no longer followed
        assert r._subscriber.keys() == {"a"} and r._subscriber.view("b") is None
    finally:
        r._subscriber.close()


def test_a_view_that_lost_batches_matches_the_digest_until_a_later_one_is_folded_in(fleet):
    (a,) = fleet("a")
    b = replica("b")
    r = cost_router(a.r, b, cache_view="events")
    try:
        _synced(r, a)
        view = r._subscriber.view("a")
        view.lost(0)
        a.r.routing_stats["digest"] = dict.fromkeys(prompt_block_hashes(P[:9], BS), TIER_DEVICE)
        a.r.routing_stats["time"] = view.lost_at - 1  # taken before the loss: matched, not folded in
        assert r.choose([a.r, b], request(P)).estimates[0].num_held_tokens == 8 and not view.synced
        a.r.routing_stats["time"] = time.time() + 1
        assert r.choose([a.r, b], request(P)).estimates[0].num_held_tokens == 8 and view.synced
        assert view.held["GPU"] == {h & U64 for h in prompt_block_hashes(P[:9], BS)}
    finally:
        r._subscriber.close()


def test_a_routed_prompt_counts_as_held_until_a_batch_after_its_end(fleet):
    a, b = fleet("a", "b")
    r = cost_router(a.r, b.r, cache_view="events")
    try:
        _synced(r, a, b)
        p, ranks = route(r, [a.r, b.r], request(P), "i1")
        where = ranks[0][0]
        r.on_request_routed(p, where.replica_id, None)
        r.on_request_completed(where.replica_id, "i1")
        assert r.choose([a.r, b.r], request(P, "again")).replica is where  # no event yet: remembered
        x = a if where is a.r else b
        x.cache(list(range(200, 210)))  # a batch published after it ended (its own prompt's is not there)
        _synced(r, a, b)
        d = r.choose([a.r, b.r], request(P, "again"))
        assert r._recent[where.replica_id] == {} and max(e.num_held_tokens for e in d.estimates) == 0
    finally:
        r._subscriber.close()


def test_events_mode_is_checked():
    with pytest.raises(ValueError, match="cache_view"):
        router(CacheAwareRouter, cache_view="digest")
    with pytest.raises(ValueError, match="cache_view"):
        router(CacheThresholdRouter, cache_view="push")


# ---------------------------------------------------------------------- retained prefixes


def test_a_cache_lists_its_retained_blocks_that_it_holds():
    clock = [0.0]
    kv = KVCacheCoordinator(num_blocks=8, block_size=BS, clock=lambda: clock[0])
    hashes = prompt_block_hashes(P[:13], BS)
    kv.retain(P, 8, ttl_s=10.0)
    assert kv.routing_digest() == ({}, [])  # asked for, not cached yet
    assert kv.allocate_slots("a", 0, 12) == []
    kv.cache_blocks("a", P[:12], 12)
    kv.free("a")
    digest = dict.fromkeys(hashes[:3], TIER_DEVICE)
    assert kv.cache_digest() == digest and kv.routing_digest() == (digest, hashes[:2])
    clock[0] = 11.0
    assert kv.routing_digest() == (digest, [])  # lapsed


def test_a_bounded_digest_keeps_the_retained_blocks_first():
    digest = {1: TIER_DEVICE, 2: TIER_DEVICE, 3: TIER_HOST, 4: TIER_HOST}
    assert bounded_digest(digest, [4], 2) == {4: TIER_HOST, 1: TIER_DEVICE}
    assert bounded_digest(digest, [4], 9) == digest


def test_retained_blocks_count_as_held_where_a_cut_digest_does_not_show_them():
    """A replica whose digest was cut to its bound still keeps its retained prefixes: the router
    follows them there."""
    keys = prompt_block_hashes(P, BS)
    a = replica("a", {keys[0]: TIER_DEVICE})
    b = replica("b")
    r = cost_router(a, b)
    assert r.choose([a, b], request(P)).estimates[0].num_held_tokens == 4
    a.routing_stats["retained"] = keys[:3]
    d = r.choose([a, b], request(P))
    assert d.replica is a and d.estimates[0].num_held_tokens == 12 and d.estimates[1].num_held_tokens == 0
    other = salted(P, "other")  # another tenant's equal tokens are other blocks
    assert routing_keys(other, BS)[0] != keys[0]
    assert r.choose([a, b], other).reason == "no_match"


def test_retained_blocks_count_as_held_where_the_event_view_lost_them(fleet):
    a, b = fleet("a", "b")
    r = cost_router(a.r, b.r, cache_view="events")
    try:
        a.cache(P)
        _synced(r, a, b)
        assert r.choose([a.r, b.r], request(P)).estimates[0].num_held_tokens == 16
        r._subscriber.view("a").lost(1)  # batches lost, and no digest since: the view shows nothing
        assert r.choose([a.r, b.r], request(P)).reason == "no_match"
        a.r.routing_stats["retained"] = a.kv.cache_digest() and prompt_block_hashes(P[:9], BS)
        d = r.choose([a.r, b.r], request(P))
        assert d.replica is a.r and d.estimates[0].num_held_tokens == 8
    finally:
        r._subscriber.close()


def test_replicas_bind_their_own_event_endpoints_and_a_shared_one_is_refused():
    from prefixkv.config import EngineConfig
    from prefixkv.serve.app import build_app
    from prefixkv.serve.replica import replica_kv_events

    on = KVEventsConfig(enable_kv_cache_events=True, topic="kv")
    assert replica_kv_events(on, "10.0.0.7") == KVEventsConfig(
        enable_kv_cache_events=True, topic="kv", endpoint="tcp://10.0.0.7:*", replay_endpoint="tcp://10.0.0.7:*")
    assert replica_kv_events(on, "fd00::7").endpoint == "tcp://[fd00::7]:*"
    assert replica_kv_events(KVEventsConfig(), "10.0.0.7") == KVEventsConfig()
    shared = EngineConfig(kv_events=KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:6000"))
    with pytest.raises(ValueError, match="kv_events_config.endpoint"):
        build_app(shared, num_replicas=2)
    with pytest.raises(ValueError, match="routing_cache_view: events applies to"):
        build_app(num_replicas=2, router="power_of_two", routing_cache_view="events")
    with pytest.raises(ValueError, match="routing_cache_view: must be one of"):
        build_app(num_replicas=2, routing_cache_view="digest")
