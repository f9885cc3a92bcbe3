"""Block hashes selectable to vLLM's, and KV events in vLLM's wire format.

The expected values come from vLLM's definitions, written out here (``vllm/utils/hashing.py``,
``vllm/v1/core/kv_cache_utils.py``, ``vllm/distributed/kv_events.py``), never from prefixkv's code;
the subscriber is vLLM's example subscriber's way of reading (pyzmq SUB + msgspec structs, a
DEALER for replay as vLLM's own tests)."""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from typing import Any

import cbor2
import msgspec
import pytest
import zmq

from prefixkv import kv_events
from prefixkv.config import KVEventsConfig
from prefixkv.kv import events as ev
from prefixkv.kv import radix
from prefixkv.kv.hashing import BlockHasher, block_hash, first_block_keys

# --- vLLM's block hashing, as vLLM writes it ----------------------------------------------------


def vllm_sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def vllm_sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def vllm_none_hash(hash_fn, pythonhashseed: str) -> bytes:  # init_none_hash, PYTHONHASHSEED set
    return hash_fn(pythonhashseed)


def vllm_hash_block_tokens(hash_fn, none_hash, parent_block_hash, curr_block_token_ids, extra_keys=None):
    if not parent_block_hash:
        parent_block_hash = none_hash
    return hash_fn((parent_block_hash, tuple(curr_block_token_ids), extra_keys))


def vllm_extra_keys(start_token_idx: int, cache_salt: str | None):
    # generate_block_hash_extra_keys for a request without LoRA, multimodal items or prompt embeds
    cache_salt_keys = [cache_salt] if (start_token_idx == 0 and cache_salt) else []
    return tuple(cache_salt_keys) if cache_salt_keys else None


def vllm_block_hashes(hash_fn, none_hash, token_ids, block_size, cache_salt=None):
    # request_block_hasher over a request's full blocks
    out, prev = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = vllm_hash_block_tokens(hash_fn, none_hash, prev, token_ids[start:start + block_size],
                                      vllm_extra_keys(start, cache_salt))
        out.append(prev)
    return out


def vllm_maybe_convert_block_hash(hash_bytes: bytes) -> int:  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1
    return int.from_bytes(hash_bytes, byteorder="big") & ((1 << 64) - 1)


PROMPT = [128000, 9906, 11, 1268, 527, 499, 30, 40, 1097, 7060, 13, 5, 0, 65535, 65536, 23, 24, 255, 256, 7]
BS = 4


@pytest.mark.parametrize("seed", ["0", "1234"])
@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_sha256_cbor_hashes_equal_vllms(seed, salt):
    none = vllm_none_hash(vllm_sha256_cbor, seed)
    expected = vllm_block_hashes(vllm_sha256_cbor, none, PROMPT, BS, salt)
    hasher = BlockHasher.create("sha256_cbor", hash_seed=seed)
    hashes: list = []
    assert hasher.extend(hashes, PROMPT, BS, first_block_keys(salt)) == expected == hashes
    assert [hasher.external(h) for h in hashes] == [vllm_maybe_convert_block_hash(h) for h in expected]
    # appending tokens hashes only the blocks that became full
    more = PROMPT + [3, 1, 4, 1, 5]
    assert hasher.extend(hashes, more, BS, first_block_keys(salt)) == vllm_block_hashes(
        vllm_sha256_cbor, none, more, BS, salt)[len(expected):]


def test_sha256_cbor_hashes_the_bytes_vllm_hashes():
    # the CBOR written by hand: NONE_HASH = sha256(text "0"), then one block (parent, tokens, salt)
    none = hashlib.sha256(bytes([0x61, 0x30])).digest()
    tokens = [1, 24, 1000, 100000]
    body = bytes([0x83, 0x58, 0x20]) + none + bytes([0x84, 0x01, 0x18, 0x18, 0x19, 0x03, 0xE8, 0x1A, 0x00, 0x01,
                                                     0x86, 0xA0])
    hasher = BlockHasher.create("sha256_cbor", hash_seed="0")
    assert hasher.root == none
    assert hasher.hash_block(None, tokens) == hashlib.sha256(body + bytes([0xF6])).digest()
    salted = body + bytes([0x81, 0x62]) + b"t1"  # extra keys ("t1",)
    assert hasher.hash_block(None, tokens, first_block_keys("t1")) == hashlib.sha256(salted).digest()


def test_sha256_hashes_equal_vllms_pickle_hash():
    none = vllm_none_hash(vllm_sha256, "0")
    hasher = BlockHasher.create("sha256", hash_seed="0")
    hashes: list = []
    hasher.extend(hashes, PROMPT, BS, first_block_keys("s"))
    assert hashes == vllm_block_hashes(vllm_sha256, none, PROMPT, BS, "s")


def test_a_salt_or_a_partition_changes_every_hash_of_the_chain():
    hasher = BlockHasher.create("sha256_cbor", hash_seed="0")
    chains = {}
    for name, keys in (("none", None), ("salt a", first_block_keys("a")), ("salt b", first_block_keys("b")),
                       ("partition a", first_block_keys(partition="a")),
                       ("partition a + salt b", first_block_keys("b", "a"))):
        chains[name] = hasher.extend([], PROMPT, BS, keys)
    assert first_block_keys("b", "a") == (("partition", "a"), "b")
    assert first_block_keys("") is None  # vLLM ignores an empty salt
    for i in range(len(PROMPT) // BS):  # no two share any block
        assert len({c[i] for c in chains.values()}) == len(chains)


def test_builtin_hash_keeps_its_values_and_its_salt_is_the_same_in_every_process():
    assert radix.block_hash is block_hash  # the name the cache and the router import
    hasher = BlockHasher.create("builtin", hash_seed=None)
    prev, expected = 0, []
    for i in range(len(PROMPT) // BS):
        prev = hash((prev, *PROMPT[i * BS:(i + 1) * BS]))
        expected.append(prev)
    assert hasher.extend([], PROMPT, BS) == expected
    salted = hasher.extend([], PROMPT, BS, first_block_keys("tenant-a", "p1"))
    assert not set(salted) & set(expected)
    code = ("from prefixkv.kv.hashing import BlockHasher, first_block_keys as k; "
            f"print(BlockHasher.create('builtin', None).extend([], {PROMPT}, {BS}, k('tenant-a', 'p1')))")
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}).stdout
        assert out.strip() == str(salted)


def test_published_form_is_the_low_64_bits_unless_asked_for_the_digest():
    hasher = BlockHasher.create("sha256_cbor", hash_seed="0")
    h = hasher.hash_block(None, [1, 2, 3, 4])
    assert hasher.external(h) == int.from_bytes(h[-8:], "big") == vllm_maybe_convert_block_hash(h)
    assert BlockHasher.create("sha256_cbor", "0", int_external=False).external(h) == h
    builtin = BlockHasher.create("builtin", None)
    assert builtin.external(-1) == 2**64 - 1 and builtin.external(5) == 5
    assert BlockHasher.create("builtin", None, int_external=False).external(-2) == b"\xff" * 7 + b"\xfe"


def test_without_pythonhashseed_the_root_is_random_as_in_vllm(caplog):
    with caplog.at_level(logging.WARNING, logger="prefixkv.kv.hashing"):
        a, b = BlockHasher.create("sha256_cbor", None), BlockHasher.create("sha256_cbor", None)
    assert a.root != b.root and len(a.root) == 32
    assert "PYTHONHASHSEED is not set" in caplog.text


@pytest.mark.parametrize("algo", ["xxhash", "md5", ""])
def test_an_unknown_hash_algorithm_is_refused_by_name(algo):
    with pytest.raises(ValueError, match="^prefix_caching_hash_algo: must be one of"):
        BlockHasher.create(algo, "0")


# --- --kv-events-config -------------------------------------------------------------------------


def test_kv_events_config_parses_vllms_json_with_its_defaults():
    assert KVEventsConfig() == KVEventsConfig.from_cli("{}")
    off = KVEventsConfig()
    assert (off.enable_kv_cache_events, off.publisher, off.endpoint, off.replay_endpoint, off.buffer_steps, off.hwm,
            off.max_queue_size, off.topic) == (False, "null", "tcp://*:5557", None, 10_000, 100_000, 100_000, "")
    on = KVEventsConfig.from_cli('{"enable_kv_cache_events": true, "topic": "kv@pod@m", '
                                 '"replay_endpoint": "tcp://*:5558", "buffer_steps": 50}')
    assert (on.publisher, on.topic, on.replay_endpoint, on.buffer_steps) == ("zmq", "kv@pod@m", "tcp://*:5558", 50)
    assert KVEventsConfig.from_cli('{"enable_kv_cache_events": true, "publisher": "null"}').publisher == "null"


@pytest.mark.parametrize("text, field", [
    ("{not json", "kv_events_config"),
    ("[1]", "kv_events_config"),
    ('{"enable_kv_cache_events": true, "buffer_size": 5}', "kv_events_config.buffer_size"),
    ('{"publisher": "kafka"}', "kv_events_config.publisher"),
    ('{"enable_kv_cache_events": "yes"}', "kv_events_config.enable_kv_cache_events"),
    ('{"endpoint": "localhost:5557"}', "kv_events_config.endpoint"),
    ('{"replay_endpoint": ""}', "kv_events_config.replay_endpoint"),
    ('{"max_queue_size": 0}', "kv_events_config.max_queue_size"),
    ('{"hwm": true}', "kv_events_config.hwm"),
    ('{"topic": 5}', "kv_events_config.topic"),
])
def test_a_bad_kv_events_config_names_its_field(text, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        KVEventsConfig.from_cli(text)


# --- events as the cache builds them ------------------------------------------------------------


def test_event_log_publishes_hashes_and_lists_extra_keys_per_block():
    hasher = BlockHasher.create("sha256_cbor", hash_seed="0")
    keys = first_block_keys("s")
    hashes = hasher.extend([], PROMPT, BS, keys)
    log = ev.KVEventLog(hasher, BS)
    log.stored(hashes[:2], None, PROMPT[:8], first_keys=keys)
    log.stored(hashes[2:3], hashes[1], PROMPT[8:12], first_keys=keys)  # not the first block: no keys
    log.stored([], hashes[2], [])  # nothing stored, no event
    log.removed(hashes[2:3], ev.MEDIUM_CPU)
    log.cleared()
    ext = [vllm_maybe_convert_block_hash(h) for h in hashes]
    assert log.take() == [
        ev.BlockStored(tuple(ext[:2]), None, tuple(PROMPT[:8]), BS, "GPU", (("s",), None)),
        ev.BlockStored((ext[2],), ext[1], tuple(PROMPT[8:12]), BS, "GPU", (None,)),
        ev.BlockRemoved((ext[2],), "CPU"),
        ev.AllBlocksCleared(),
    ]
    assert log.take() == []
    with pytest.raises(ValueError, match="^token_ids: 7 tokens for 2 blocks of 4"):
        log.stored(hashes[:2], None, PROMPT[:7])


# --- the wire: a subscriber as vLLM's ------------------------------------------------------------
# vllm/distributed/kv_events.py: the batch is an array, each event a map tagged "type" (#42892)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


END_SEQ = (-1).to_bytes(8, "big", signed=True)


class Subscriber:
    """Live batches from the SUB socket; a gap in the sequence (or a quiet socket while batches are
    still due) is filled from the replay socket, as vLLM's example subscriber does."""

    def __init__(self, pub: kv_events.ZmqEventPublisher, topic: str) -> None:
        ctx = zmq.Context.instance()
        self.topic = topic.encode()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.sub.connect(pub.endpoint)
        self.replay = ctx.socket(zmq.DEALER)
        self.replay.connect(pub.replay_endpoint)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.payloads: dict[int, bytes] = {}

    def request_replay(self, start_seq: int) -> list[list[bytes]]:
        self.replay.send_multipart([b"", start_seq.to_bytes(8, "big")])
        replies = []
        while True:
            assert self.replay.poll(5000), "no end of replay"
            frames = self.replay.recv_multipart()[1:]  # after the empty delimiter
            replies.append(frames)
            if frames[1] == END_SEQ:
                assert frames == [b"", END_SEQ, b""]
                return replies

    def collect(self, n: int, timeout_s: float = 20.0) -> list[tuple[int, KVEventBatch]]:
        deadline = time.monotonic() + timeout_s
        while len(self.payloads) < n:
            assert time.monotonic() < deadline, f"{len(self.payloads)} of {n} batches"
            if self.sub.poll(300):
                topic, seq_bytes, payload = self.sub.recv_multipart()
                assert topic == self.topic
                seq = int.from_bytes(seq_bytes, "big")
                if seq > len(self.payloads):
                    self._fill(len(self.payloads))
                self.payloads[seq] = payload
            else:
                self._fill(len(self.payloads))
        assert sorted(self.payloads) == list(range(len(self.payloads)))
        return [(s, self.decoder.decode(self.payloads[s])) for s in sorted(self.payloads)]

    def _fill(self, start: int) -> None:
        for topic, seq_bytes, payload in self.request_replay(start)[:-1]:
            assert topic == self.topic
            self.payloads.setdefault(int.from_bytes(seq_bytes, "big"), payload)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.replay.close(linger=0)


@pytest.fixture
def wire():
    opened = []

    def start(**overrides):
        cfg = dict(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                   topic="kv@test")
        cfg.update(overrides)
        pub = kv_events.create_publisher(KVEventsConfig(**cfg))
        sub = Subscriber(pub, cfg["topic"])
        opened.append((pub, sub))
        return pub, sub

    yield start
    for pub, sub in opened:
        pub.shutdown()
        sub.close()


def test_subscriber_decodes_our_batches_and_rebuilds_the_cached_prefix(wire):
    pub, sub = wire()
    hasher = BlockHasher.create("sha256_cbor", hash_seed="0")
    keys = first_block_keys("tenant-a")
    hashes = hasher.extend([], PROMPT, BS, keys)
    log = ev.KVEventLog(hasher, BS)
    log.stored(hashes[:3], None, PROMPT[:12], first_keys=keys)  # one step caches 3 blocks
    assert pub.publish(log.take(), ts=1700000000.5)
    log.stored(hashes[3:5], hashes[2], PROMPT[12:20])  # the next, 2 more
    log.removed(hashes[4:5])
    log.stored(hashes[4:5], hashes[3], PROMPT[16:20], medium=ev.MEDIUM_CPU)
    assert pub.publish(log.take())
    assert pub.publish([])  # an empty step sends nothing
    log.cleared()
    assert pub.publish(log.take())

    batches = sub.collect(3)
    assert [seq for seq, _ in batches] == [0, 1, 2]
    first, second, third = (b for _, b in batches)
    assert first.ts == 1700000000.5 and first.data_parallel_rank == 0
    # the consumer hashes the prompt as vLLM does (same PYTHONHASHSEED and salt) and finds our blocks
    vllm = [vllm_maybe_convert_block_hash(h) for h in vllm_block_hashes(
        vllm_sha256_cbor, vllm_none_hash(vllm_sha256_cbor, "0"), PROMPT, BS, "tenant-a")]
    (s1,) = first.events
    assert isinstance(s1, BlockStored)
    assert (s1.block_hashes, s1.parent_block_hash, s1.token_ids, s1.block_size, s1.medium, s1.extra_keys,
            s1.lora_id, s1.lora_name, s1.group_idx, s1.kv_cache_spec_kind) == (
        vllm[:3], None, PROMPT[:12], BS, "GPU", [("tenant-a",), None, None], None, None, 0, "full_attention")
    s2, r, s3 = second.events
    assert (s2.block_hashes, s2.parent_block_hash, s2.token_ids, s2.extra_keys) == (
        vllm[3:5], vllm[2], PROMPT[12:20], [None, None])
    assert (r.block_hashes, r.medium) == ([vllm[4]], "GPU") and isinstance(r, BlockRemoved)
    assert (s3.block_hashes, s3.parent_block_hash, s3.medium) == ([vllm[4]], vllm[3], "CPU")
    assert [type(e) for e in third.events] == [AllBlocksCleared]
    # the chain of parents and tokens reproduces the cached prefix
    by_hash = {}
    for e in first.events + second.events[:1]:
        parent = e.parent_block_hash
        for i, h in enumerate(e.block_hashes):
            by_hash[h] = (parent, e.token_ids[i * BS:(i + 1) * BS])
            parent = h
    tokens, h = [], vllm[4]
    while h is not None:
        parent, block = by_hash[h]
        tokens[:0] = block
        h = parent
    assert tokens == PROMPT[:20]


def test_wire_shape_is_vllms_array_batch_of_tagged_maps(wire):
    pub, sub = wire(topic="")
    hasher = BlockHasher.create("builtin", None)
    log = ev.KVEventLog(hasher, 2)
    log.stored([-5, 7], None, [1, 2, 3, 4], first_keys=("s",))
    log.removed([9], "STORAGE")
    log.cleared()
    pub.publish(log.take(), ts=2.5)
    sub.collect(1)
    assert msgspec.msgpack.decode(sub.payloads[0]) == [2.5, [
        {"type": "BlockStored", "block_hashes": [2**64 - 5, 7], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
         "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [["s"], None],
         "group_idx": 0, "kv_cache_spec_kind": "full_attention"},
        {"type": "BlockRemoved", "block_hashes": [9], "medium": "STORAGE", "group_idx": 0},
        {"type": "AllBlocksCleared"}], 0]


def test_replay_answers_missed_batches_and_ends_with_vllms_marker(wire):
    pub, sub = wire(buffer_steps=4)
    for i in range(6):
        assert pub.publish([ev.BlockRemoved((i,), "GPU")])
    # the replay socket, not the live one (a SUB socket connected late misses the first batches,
    # which the 4 kept cannot fill): asked until the publisher's thread has sent all six
    deadline = time.monotonic() + 20
    while [int.from_bytes(s, "big") for _, s, _ in sub.request_replay(0)[:-1]] != [2, 3, 4, 5]:
        assert time.monotonic() < deadline, "the publisher did not keep the last 4 batches"
        time.sleep(0.05)
    replies = sub.request_replay(3)
    assert [(t, int.from_bytes(s, "big")) for t, s, _ in replies[:-1]] == [(b"kv@test", s) for s in (3, 4, 5)]
    assert [sub.decoder.decode(p).events[0].block_hashes for _, _, p in replies[:-1]] == [[3], [4], [5]]
    assert sub.request_replay(6) == [[b"", END_SEQ, b""]]


def test_a_full_queue_drops_the_batch_and_tells_subscribers_to_clear(wire, monkeypatch):
    entered, release = threading.Event(), threading.Event()
    to_wire = kv_events.to_wire

    def slow_to_wire(*args):
        if not entered.is_set():
            entered.set()
            release.wait(10)
        return to_wire(*args)

    monkeypatch.setattr(kv_events, "to_wire", slow_to_wire)
    pub, sub = wire(max_queue_size=2)
    assert pub.publish([ev.BlockRemoved((0,), "GPU")])
    assert entered.wait(10)  # the thread holds batch 0; the queue has room for 2
    assert pub.publish([ev.BlockRemoved((1,), "GPU")]) and pub.publish([ev.BlockRemoved((2,), "GPU")])
    assert not pub.publish([ev.BlockRemoved((3,), "GPU")])  # never blocks the step
    assert pub.num_dropped_batches == 1
    release.set()
    sub.collect(3)  # the thread has taken batches 1 and 2 off the queue
    assert pub.publish([ev.BlockRemoved((4,), "GPU")])
    assert pub.publish([ev.BlockRemoved((5,), "GPU")])
    events = [[(type(e).__name__, getattr(e, "block_hashes", None)) for e in b.events] for _, b in sub.collect(5)]
    assert events == [[("BlockRemoved", [0])], [("BlockRemoved", [1])], [("BlockRemoved", [2])],
                      [("AllBlocksCleared", None), ("BlockRemoved", [4])], [("BlockRemoved", [5])]]


def test_publisher_selection_and_per_rank_addresses():
    assert isinstance(kv_events.create_publisher(None), kv_events.NullEventPublisher)
    assert isinstance(kv_events.create_publisher(KVEventsConfig(publisher="zmq")), kv_events.NullEventPublisher)
    null = kv_events.create_publisher(KVEventsConfig(enable_kv_cache_events=True, publisher="null"))
    assert isinstance(null, kv_events.NullEventPublisher) and null.publish([ev.AllBlocksCleared()])
    assert kv_events.offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert kv_events.offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert kv_events.offset_endpoint_port("inproc://kv", 1) == "inproc://kv_dp1"
    assert kv_events.offset_endpoint_port(None, 1) is None
    with pytest.raises(ValueError, match="^kv_events_config.endpoint: "):
        kv_events.offset_endpoint_port("ipc:///tmp/kv", 1)


def test_an_address_in_use_is_a_clear_error():
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint="inproc://kv-in-use")
    first = kv_events.create_publisher(cfg)
    try:
        with pytest.raises(ValueError, match="^kv_events_config.endpoint: cannot bind 'inproc://kv-in-use'"):
            kv_events.create_publisher(cfg)
    finally:
        first.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        first.publish([ev.AllBlocksCleared()])


def test_the_modules_import_no_msgspec_zmq_or_cbor2():
    code = ("import sys, prefixkv, prefixkv.kv_events, prefixkv.kv.events, prefixkv.kv.hashing; "
            "print(sorted(m for m in ('msgspec', 'zmq', 'cbor2', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
