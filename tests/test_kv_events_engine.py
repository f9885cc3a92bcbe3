"""KV events from a running engine: the engine-core process of ``prefixkv serve`` and the
in-process engine publish what the cache stores and drops, in every tier, as vLLM's wire format.

A subscriber decodes the bytes as vLLM defines the schema (test_kv_events.py's structs and
subscriber), rebuilds each medium's blocks from the events alone, and must end up with what the
engine reports it holds; the published hashes with ``sha256_cbor`` are vLLM's, computed here from
vLLM's definition (cbor2 + hashlib), not from prefixkv's hasher."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from types import SimpleNamespace

import pytest
from test_kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Subscriber,
    vllm_block_hashes,
    vllm_maybe_convert_block_hash,
    vllm_none_hash,
    vllm_sha256_cbor,
)

from prefixkv.config import CacheConfig, EngineConfig, KVEventsConfig, SchedulerConfig
from prefixkv.engine_args import EngineArgs
from prefixkv.engine_core.client import EngineCoreClient
from prefixkv.sampling_params import SamplingParams

BS = 4
SEED = "1234"  # PYTHONHASHSEED of the engine core: vLLM's sha256_cbor chain starts from its hash
TOPIC = "kv@engine"


@pytest.fixture
def sockets():
    """A short directory for ipc:// sockets (their paths are limited to about 100 characters)."""
    d = tempfile.mkdtemp(prefix="kvev", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _config(model, sockets: str, **cache) -> EngineConfig:
    events = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{sockets}/pub",
                            replay_endpoint=f"ipc://{sockets}/replay", topic=TOPIC)
    return EngineConfig(model=str(model), dtype="float64",
                        cache=CacheConfig(**{"block_size": BS, "num_kv_blocks": 24, **cache}),
                        scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=4), kv_events=events)


def _batches(sub: Subscriber) -> list[tuple[int, object]]:
    """Every batch published so far, from the replay socket (sequence 0 on)."""
    frames = sub.request_replay(0)[:-1]
    seqs = [int.from_bytes(f[1], "big") for f in frames]
    assert seqs == list(range(len(seqs))), seqs
    return [(s, sub.decoder.decode(f[2])) for s, f in zip(seqs, frames)]


class Model:
    """Each medium's blocks as the events tell them, with each GPU block's parent, tokens and
    extra keys."""

    def __init__(self) -> None:
        self.held: dict[str, set] = {"GPU": set(), "CPU": set(), "STORAGE": set()}
        self.parent: dict = {}
        self.tokens: dict = {}
        self.extra_keys: dict = {}
        self.removed: dict[str, set] = {m: set() for m in self.held}
        self.num_cleared = 0

    def apply(self, event) -> None:
        if isinstance(event, BlockStored):
            assert event.lora_id is None and event.lora_name is None and event.block_size == BS
            assert len(event.token_ids) == BS * len(event.block_hashes) == BS * len(event.extra_keys)
            held = self.held[event.medium]
            for k, h in enumerate(event.block_hashes):
                assert h not in held, f"{event.medium} told to store {h} twice"
                held.add(h)
                if event.medium == "GPU":
                    self.parent[h] = event.parent_block_hash if k == 0 else event.block_hashes[k - 1]
                    self.tokens[h] = list(event.token_ids[k * BS:(k + 1) * BS])
                    self.extra_keys[h] = event.extra_keys[k]
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                assert h in self.held[event.medium], f"{event.medium} told to remove {h}, which it was not told of"
                self.held[event.medium].discard(h)
                self.removed[event.medium].add(h)
        else:
            assert isinstance(event, AllBlocksCleared)
            self.num_cleared += 1
            for held in self.held.values():
                held.clear()


def _vllm_hashes(tokens: list[int], salt: str | None = None) -> list[int]:
    none = vllm_none_hash(vllm_sha256_cbor, SEED)
    return [vllm_maybe_convert_block_hash(h) for h in vllm_block_hashes(vllm_sha256_cbor, none, tokens, BS, salt)]


async def _generate(client, rid: str, prompt: list[int], max_tokens: int = 3, **params):
    p = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params)
    return [o async for o in client.generate(rid, prompt, p)][-1]


@pytest.fixture
def core_with_events(tiny_llama, tmp_path, sockets, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", SEED)  # the spawned core reads it, as vLLM's engine does
    # a page of the tiny model in float64: 2 layers x K and V x 2 heads x 16 x 4 tokens x 8 bytes = 2 KiB,
    # so 8 host slots and 8 files
    cfg = _config(tiny_llama, sockets, prefix_caching_hash_algo="sha256_cbor", host_cache_bytes=1 << 14,
                  disk_cache_dir=str(tmp_path / "disk"), disk_cache_bytes=1 << 14)
    client = EngineCoreClient.launch(cfg)
    sub = Subscriber(SimpleNamespace(endpoint=cfg.kv_events.endpoint, replay_endpoint=cfg.kv_events.replay_endpoint),
                     TOPIC)
    yield client, sub
    sub.close()
    client.close()
    assert client._process.exitcode == 0


def test_the_core_publishes_every_tier_with_vllms_hashes_and_clears_on_reset(core_with_events):
    """Through the engine-core process: 12 prompts (4 blocks cached each) that overflow a 24-block pool, a host tier and a
    disk tier. The GPU events rebuild each prompt's chain with vLLM's sha256_cbor hashes, token ids
    and parents; evicted blocks are removed from "GPU" and stored in "CPU", then "STORAGE"; each
    medium's blocks, rebuilt from the events alone, are what the engine holds; a salted request's
    first block carries the salt, never its partition; a reset tells AllBlocksCleared."""
    client, sub = core_with_events
    prompts = [[(7 * i + 3 * j) % 200 + 1 for j in range(14)] for i in range(12)]
    salted = [5, 6, 7, 8, 9, 10, 11, 12, 13]

    async def run():
        for i, prompt in enumerate(prompts):
            await _generate(client, f"r{i}", prompt)
        await _generate(client, "salted", salted, cache_salt="tenant-a")
        await _generate(client, "partitioned", salted, cache_salt="tenant-a", cache_partition="secret-partition")
        return await client.call("stats")

    stats = asyncio.run(run())
    live = sub.collect(1)  # the live socket got batches too (the first ones may precede the subscription)
    batches = _batches(sub)
    assert {s: b for s, b in live} == {s: b for s, b in batches if s in dict(live)}
    model = Model()
    for _, batch in batches:
        assert batch.data_parallel_rank == 0
        for e in batch.events:
            model.apply(e)

    # each medium holds what the engine holds (nothing runs: every cached device block is evictable)
    assert stats["num_running"] == 0 and stats["num_kv_blocks_used"] == 0
    assert len(model.held["GPU"]) == stats["num_kv_blocks_evictable"] > 0
    assert len(model.held["CPU"]) == stats["num_host_blocks_used"] > 0
    assert len(model.held["STORAGE"]) == stats["num_disk_blocks_used"] > 0
    assert model.removed["GPU"] and model.removed["CPU"] and model.removed["STORAGE"]
    # what the device let go of went to the host tier, what the host tier let go of to files
    cpu_ever = model.held["CPU"] | model.removed["CPU"]
    assert model.removed["GPU"] <= cpu_ever and model.removed["CPU"] <= model.held["STORAGE"] | model.removed["STORAGE"]

    # the chains: vLLM's hashes of each prompt's full blocks, their tokens and parents
    for prompt in prompts:
        expected = _vllm_hashes(prompt)
        assert len(expected) == 3
        for i, h in enumerate(expected):
            assert model.tokens[h] == prompt[i * BS:(i + 1) * BS]
            assert model.parent[h] == (expected[i - 1] if i else None)
            assert model.extra_keys[h] is None
    last = _vllm_hashes(prompts[-1])
    assert set(last) <= model.held["GPU"]  # the last prompt's blocks are still on the device

    # a salt: vLLM's salted hashes, the salt in the first block's extra keys
    salted_hashes = _vllm_hashes(salted, "tenant-a")
    assert salted_hashes != _vllm_hashes(salted)
    assert model.extra_keys[salted_hashes[0]] == ("tenant-a",) and model.extra_keys[salted_hashes[1]] is None
    assert model.parent[salted_hashes[1]] == salted_hashes[0]
    # the partitioned request shares nothing with the salted one, tells its salt and never its partition
    partitioned = [h for h, keys in model.extra_keys.items() if keys == ("tenant-a",) and h != salted_hashes[0]]
    assert len(partitioned) == 1 and model.tokens[partitioned[0]] == salted[:BS]
    assert not any(b"secret-partition" in f[2] for f in sub.request_replay(0)[:-1])

    # a reset drops every tier and says so
    assert asyncio.run(client.call("reset_prefix_cache")) is True
    after = _batches(sub)[len(batches):]
    assert after and isinstance(after[-1][1].events[-1], AllBlocksCleared)
    for _, batch in after:
        for e in batch.events:
            model.apply(e)
    stats = asyncio.run(client.call("stats"))
    assert model.num_cleared == 1 and not any(model.held.values())
    assert stats["num_kv_blocks_evictable"] == stats["num_host_blocks_used"] == stats["num_disk_blocks_used"] == 0

    # and what is cached afterwards is told again from the first block
    asyncio.run(_generate(client, "again", prompts[0]))
    for _, batch in _batches(sub)[len(batches) + len(after):]:
        for e in batch.events:
            model.apply(e)
    assert set(_vllm_hashes(prompts[0])) <= model.held["GPU"]


def test_reset_is_refused_while_a_request_holds_blocks(tiny_llama, sockets):
    from prefixkv.llm import LLM

    llm = LLM(model=str(tiny_llama), dtype="float64", block_size=BS, num_kv_blocks=32,
              kv_events_config={"enable_kv_cache_events": True, "endpoint": f"ipc://{sockets}/pub"})
    try:
        engine = llm.engine
        engine.add_request("a", list(range(1, 12)), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        engine.step()
        assert engine.reset_prefix_cache() is False and engine.scheduler.kv.num_cached_blocks > 0
        while engine.has_unfinished():
            engine.step()
        assert engine.reset_prefix_cache() is True and engine.scheduler.kv.num_cached_blocks == 0
    finally:
        llm.close()


def test_the_in_process_engine_publishes_its_own_hashes_by_default(tiny_llama, sockets):
    """``LLM`` (the engine stepped in this process): builtin hashes are the cache's own chain (an
    int64 of the parent and the tokens), published as their low 64 bits; one batch per step; the
    publisher closed by ``close``."""
    from prefixkv.kv.hashing import block_hash
    from prefixkv.llm import LLM

    pub = f"ipc://{sockets}/pub"
    llm = LLM(model=str(tiny_llama), dtype="float64", block_size=BS, num_kv_blocks=32,
              kv_events_config=f'{{"enable_kv_cache_events": true, "endpoint": "{pub}", '
                               f'"replay_endpoint": "ipc://{sockets}/replay", "topic": "t"}}')
    sub = Subscriber(SimpleNamespace(endpoint=pub, replay_endpoint=f"ipc://{sockets}/replay"), "t")
    try:
        prompt = list(range(1, 11))
        llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        events = [e for _, b in _batches(sub) for e in b.events]
        h0 = block_hash(0, prompt[:4])
        h1 = block_hash(h0, prompt[4:8])
        assert events == [BlockStored(block_hashes=[h0 & (2**64 - 1), h1 & (2**64 - 1)], parent_block_hash=None,
                                      token_ids=prompt[:8], block_size=BS, lora_id=None, medium="GPU", lora_name=None,
                                      extra_keys=[None, None], group_idx=0, kv_cache_spec_kind="full_attention")]
        assert llm.engine.num_steps >= 2 and len(_batches(sub)) == 1  # steps that cached nothing sent nothing
    finally:
        sub.close()
        llm.close()
    assert llm.engine.kv_event_publisher._closed


def test_events_are_off_by_default_and_bad_settings_name_their_field(tiny_llama):
    from prefixkv.llm import LLM

    llm = LLM(model=str(tiny_llama), dtype="float64", block_size=BS, num_kv_blocks=32)
    try:
        assert llm.engine.kv_events is None and llm.engine.kv_event_publisher is None
        assert llm.engine.scheduler.kv.events is None and llm.engine.scheduler.tiers.events is None
    finally:
        llm.close()
    with pytest.raises(ValueError, match="^prefix_caching_hash_algo: "):
        EngineArgs(prefix_caching_hash_algo="md5").create_engine_config()
    with pytest.raises(ValueError, match="^kv_events_config.publisher: "):
        EngineArgs(kv_events_config='{"enable_kv_cache_events": true, "publisher": "kafka"}').create_engine_config()
    with pytest.raises(ValueError, match="^kv_events_config.bogus: unknown field"):
        EngineArgs(kv_events_config={"bogus": 1}).create_engine_config()
    with pytest.raises(ValueError, match="^kv_events_config: "):
        EngineArgs(kv_events_config=3).create_engine_config()
