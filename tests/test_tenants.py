"""Tenants (issue 45): ``cache_salt`` and ``--cache-isolation api-key`` partition the prefix cache.

Requests share prefix-cache blocks only with requests of the same salt and partition: in the device
index, after eviction to the host tier, from disk after a restart, in the digests the router matches
(one function computes a request's keys for the engine and the router), across the engine-core
process; outputs are the same whatever the salt. API keys: two keys share nothing, one key shares
with itself, a salt cannot cross partitions; metrics per partition carry no key. A cross-tenant
request's time to first token is a cold request's, not a hit's (a rank statistic over many trials).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from prefixkv import LLM, SamplingParams
from prefixkv.config import CacheConfig, EngineConfig, SchedulerConfig
from prefixkv.kv.coordinator import KVCacheCoordinator
from prefixkv.kv.keys import cache_root, hash_blocks
from prefixkv.kv.tiers import TierConnector
from prefixkv.serve.digest import match_digest
from prefixkv.serve.replica import ReplicaRequest
from prefixkv.serve.router import routing_keys
from prefixkv.server.app import BackgroundServer, ServerConfig

from test_disk_tier import _llm as _disk_llm
from test_lossless import hf_reference

PROMPT = [5 + (i * 7) % 240 for i in range(37)]  # 9 full blocks of 4 (the last token is always computed)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _params(salt: str | None = None, partition: str | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, cache_salt=salt, cache_partition=partition)


# ---------------------------------------------------------------------- keys
def test_a_salt_or_a_partition_starts_another_chain_the_same_in_every_process():
    assert cache_root() == cache_root(None, None) == 0  # unsalted: the chain every cache had before
    roots = {cache_root("a"), cache_root("b"), cache_root(None, "a"), cache_root("a", "a"), cache_root("b", "a")}
    assert len(roots) == 5 and 0 not in roots  # a salt never spells a partition
    chains = [hash_blocks(PROMPT, [], 9, 4, r) for r in roots | {0}]
    for i in range(9):  # no two chains share a block
        assert len({c[i] for c in chains}) == len(chains)
    code = "from prefixkv.kv.keys import cache_root; print(cache_root('tenant', 'p'))"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2")}
    assert outs == {str(cache_root("tenant", "p"))}  # the disk tier and the router agree after a restart


@pytest.mark.parametrize("bad", ["", 3])
def test_a_salt_or_a_partition_is_a_non_empty_string(bad):
    for name in ("cache_salt", "cache_partition"):
        with pytest.raises(ValueError, match=f"^{name}: must be a non-empty string"):
            SamplingParams(**{name: bad})


# ---------------------------------------------------------------------- the KV cache
def _cache(kv: KVCacheCoordinator, seq_id: str, tokens: list[int], root: int) -> None:
    """A request that computed ``tokens`` (its full blocks cached), then finished."""
    assert kv.allocate_slots(seq_id, 0, len(tokens)) == []
    kv.cache_blocks(seq_id, tokens, len(tokens), [], root)
    kv.free(seq_id)


def test_salts_hit_and_miss_in_the_device_index_and_the_host_tier():
    a, b = cache_root("a"), cache_root("b")
    kv = KVCacheCoordinator(num_blocks=24, block_size=4, lower=TierConnector(num_host_pages=32))
    _cache(kv, "r0", PROMPT[:32], a)
    _cache(kv, "r1", PROMPT[:32], 0)  # the same tokens unsalted: their own blocks
    kv.check_integrity()
    assert kv.num_cached_blocks == 16
    probe = PROMPT[:33]
    assert kv.match_prefix(probe, root=a).num_tokens == 32
    assert kv.match_prefix(probe, root=0).num_tokens == 32
    assert kv.match_prefix(probe, root=b).num_tokens == 0
    assert set(kv.match_prefix(probe, root=a).blocks[0]).isdisjoint(kv.match_prefix(probe, root=0).blocks[0])
    assert len(kv.evict(24)) == 16  # every block to the host tier
    kv.check_integrity()
    assert kv.num_cached_blocks == 0
    hit = kv.match_prefix(probe, [], lower=True, root=a)
    assert hit.num_tokens == 32 and len(hit.lower) == 8
    assert kv.match_prefix(probe, [], lower=True, root=0).num_tokens == 32
    assert kv.match_prefix(probe, [], lower=True, root=b).num_tokens == 0
    assert kv.match_prefix(probe, [], lower=True, root=cache_root(None, "a")).num_tokens == 0


def test_salts_in_a_sliding_window_cache():
    """A model whose every layer is windowed keeps its blocks in a map by hash: the salt is in it."""
    a = cache_root("a")
    kv = KVCacheCoordinator(num_blocks=24, block_size=4, windows=(8,))
    _cache(kv, "r0", PROMPT[:32], a)
    kv.check_integrity()
    assert kv.match_prefix(PROMPT[:33], root=a).num_tokens == 32
    assert kv.match_prefix(PROMPT[:33], root=0).num_tokens == 0
    assert kv.match_prefix(PROMPT[:33], root=cache_root("b")).num_tokens == 0


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=str(tiny_llama), dtype="float64", block_size=4, num_kv_blocks=64, max_num_batched_tokens=256)


def test_same_salt_hits_another_misses_and_the_outputs_are_the_same(llm, tiny_llama):
    llm.engine.check_integrity_each_step = True
    first = llm.generate([PROMPT], _params("a"))[0]
    runs = {(salt, part): llm.generate([PROMPT], _params(salt, part))[0]
            for salt, part in [("a", None), ("b", None), (None, None), (None, "a"), ("a", "p")]}
    assert first.num_cached_tokens == 0
    assert runs["a", None].num_cached_tokens == 36
    assert [runs[k].num_cached_tokens for k in [("b", None), (None, None), (None, "a"), ("a", "p")]] == [0] * 4
    assert llm.generate([PROMPT], _params())[0].num_cached_tokens == 36  # the unsalted run cached its own
    expected = hf_reference(tiny_llama, [PROMPT], max_tokens=6)[0]
    assert {tuple(o.outputs[0].token_ids) for o in [first, *runs.values()]} == {tuple(expected)}
    llm.engine.check_integrity()


def test_the_router_matches_a_request_by_its_salt(llm):
    """The replica's digest and the router's keys come from the same function: a salted request
    matches the blocks its salt cached, and those only."""
    prompt = [250 - i for i in range(29)]
    llm.generate([prompt], _params("r", "p"))
    digest = llm.engine.scheduler.kv.cache_digest()

    def matched(salt, part):
        return match_digest(routing_keys(ReplicaRequest("x", prompt, _params(salt, part)), 4), digest).num_blocks

    assert matched("r", "p") == 7
    assert matched(None, None) == matched("r", None) == matched(None, "p") == matched("p", "r") == 0


def test_a_restarted_server_serves_one_salts_files_to_that_salt_alone(tiny_llama, tmp_path):
    probe = LLM(model=str(tiny_llama), dtype="float64", block_size=4, num_kv_blocks=40)
    a = _disk_llm(tiny_llama, tmp_path, probe=probe)
    a.generate([PROMPT], _params("a"))
    a.close()  # a clean shutdown writes every cached block to its file
    del a
    outs = []
    for salt in ("b", None, "a"):  # (other salts first: a hit would bring "a"'s blocks back to the device)
        b = _disk_llm(tiny_llama, tmp_path, probe=probe)
        outs.append(b.generate([PROMPT], _params(salt))[0])
        assert b.engine.scheduler.tiers.disk.num_used >= 9
        b.close()
        del b
    assert [o.num_cached_tokens for o in outs] == [0, 0, 36]
    expected = hf_reference(tiny_llama, [PROMPT], max_tokens=6)[0]
    assert all(o.outputs[0].token_ids == expected for o in outs)


# ---------------------------------------------------------------------- the server
KEYS = ("tenant-zero-Secret-0", "tenant-one-Secret-1")


@pytest.fixture(scope="module")
def server(tiny_llama):
    """Two API keys, the cache partitioned by key, the engine in its own process (a salt and a
    partition cross ``AddRequests``)."""
    from prefixkv.engine_core.client import EngineCoreClient

    config = EngineConfig(model=str(tiny_llama), dtype="float64", cache=CacheConfig(block_size=4, num_kv_blocks=256),
                          scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8))
    core = EngineCoreClient.launch(config)
    try:
        with BackgroundServer(core, ServerConfig("tiny", api_key=KEYS[0], api_keys=KEYS[1:],
                                                 cache_isolation="api-key")) as srv:
            yield srv
    finally:
        core.close()


def _post(srv, path: str, body: dict, key: str = KEYS[0], header: str = "Authorization") -> tuple[int, dict]:
    value = f"Bearer {key}" if header == "Authorization" else key
    req = urllib.request.Request(srv.url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json", header: value})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _cached(srv, prompt: list[int], key: str = KEYS[0], salt: str | None = None) -> int:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    status, out = _post(srv, "/v1/completions", body, key)
    assert status == 200, out
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_two_keys_share_nothing_one_key_shares_with_itself(server):
    p = [7 + i % 200 for i in range(41)]
    assert _cached(server, p, KEYS[0]) == 0
    assert _cached(server, p, KEYS[0]) == 40
    assert _cached(server, p, KEYS[1]) == 0  # the other tenant: cold
    assert _cached(server, p, KEYS[1]) == 40  # ... and now its own copy
    q = [9 + i % 190 for i in range(41)]
    assert _cached(server, q, KEYS[0], salt="shared") == 0
    assert _cached(server, q, KEYS[1], salt="shared") == 0  # a salt cannot cross partitions
    assert _cached(server, q, KEYS[0], salt="shared") == 40
    assert _cached(server, q, KEYS[0]) == 0 and _cached(server, q, KEYS[0], salt="other") == 0


def test_the_salt_reaches_the_engine_from_every_api(server):
    """chat, completions, Responses and Messages (x-api-key, Anthropic's header) each carry it:
    the same request twice with one salt hits, a third with another salt does not."""
    msg = [{"role": "user", "content": "tell me about the weather on the coast " * 3}]
    cases = [
        ("/v1/chat/completions", {"messages": msg, "max_tokens": 2, "temperature": 0}, "Authorization",
         lambda out: out["usage"]["prompt_tokens_details"]["cached_tokens"]),
        ("/v1/responses", {"input": msg, "max_output_tokens": 2, "temperature": 0, "store": False}, "Authorization",
         lambda out: out["usage"]["input_tokens_details"]["cached_tokens"]),
        ("/v1/messages", {"messages": msg, "max_tokens": 2, "temperature": 0, "model": "tiny"}, "x-api-key",
         lambda out: out["usage"]["cache_read_input_tokens"]),
    ]
    for path, body, header, cached in cases:
        seen = []
        for salt in (f"{path}-1", f"{path}-1", f"{path}-2"):
            status, out = _post(server, path, {**body, "cache_salt": salt}, KEYS[1], header)
            assert status == 200, (path, out)
            seen.append(cached(out))
        assert seen[0] == 0 and seen[1] > 0 and seen[2] == 0, (path, seen)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 1}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "model": "tiny"}),
])
@pytest.mark.parametrize("salt", ["", 7, ["a"]])
def test_a_bad_salt_is_a_400_naming_the_field(server, path, body, salt):
    status, out = _post(server, path, {**body, "cache_salt": salt})
    assert status == 400, out
    err = out["error"]
    assert "cache_salt" in err["message"]
    if path != "/v1/messages":  # (Anthropic's error shape has no param)
        assert err["param"] == "cache_salt"


def test_metrics_per_partition_carry_no_key(server):
    _cached(server, [11] * 9, KEYS[1])
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    assert all(k not in text for k in KEYS)
    lines = [line for line in text.splitlines() if line.startswith("prefixkv_partition_requests_total")]
    assert {line.split('"')[1] for line in lines} == {"key0", "key1"}, lines


def test_cli_keys_isolation_and_no_key_in_the_config_repr(tmp_path):
    from prefixkv.cli import build_parser, server_config_from_args

    keys_file = tmp_path / "keys"
    keys_file.write_text("# tenants\nk-two\n\nk-three\n")
    args = build_parser().parse_args(["serve", "--api-key", "k-one", "--api-key", "k-two", "--api-keys-file",
                                      str(keys_file), "--cache-isolation", "api-key"])
    config = server_config_from_args(args)
    assert config.keys == ("k-one", "k-two", "k-three") and config.cache_isolation == "api-key"
    assert "k-one" not in repr(config) and "k-three" not in repr(config)
    with pytest.raises(ValueError, match="^cache_isolation: 'api-key' partitions"):
        ServerConfig("m", cache_isolation="api-key")
    with pytest.raises(ValueError, match="^cache_isolation: must be one of"):
        ServerConfig("m", api_key="k", cache_isolation="salt")


# ---------------------------------------------------------------------- the timing side channel
def _ttft(engine, rid: str, prompt: list[int], params: SamplingParams) -> float:
    """Seconds from add_request to the first token, stepping the engine alone."""
    t = time.perf_counter()
    engine.add_request(rid, prompt, params)
    while not any(o.outputs[0].token_ids for o in engine.step()):
        pass
    dt = time.perf_counter() - t
    while engine.has_unfinished():
        engine.step()
    return dt


def test_a_cross_tenant_request_times_like_a_cold_one_not_a_hit(tiny_llama):
    """Per trial a fresh 960-token prompt: tenant A's first request (cold), then A's second (a hit)
    and tenant B's (cross) in alternating order. Paired within each trial (the machine's speed
    drifts between trials, not within one): the cross-tenant request is slower than the hit in
    nearly every trial, and slower than the cold one in about half (rank statistics, no
    wall-clock threshold)."""
    llm = LLM(model=str(tiny_llama), dtype="float32", block_size=16, num_kv_blocks=1024,
              max_num_batched_tokens=1024)
    engine = llm.engine
    params = {t: SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, cache_partition=t) for t in "AB"}
    for i in range(6):
        _ttft(engine, f"warm{i}", [3 + i] * 960, params["A"])
    cold, hit, cross = [], [], []
    for i in range(30):
        prompt = [(i * 131 + j * 7) % 250 + 3 for j in range(960)]
        cold.append(_ttft(engine, f"c{i}", prompt, params["A"]))
        order = [("h", "A"), ("x", "B")] if i % 2 else [("x", "B"), ("h", "A")]
        for kind, t in order:
            (hit if kind == "h" else cross).append(_ttft(engine, f"{kind}{i}", prompt, params[t]))
    medians = [statistics.median(v) for v in (cold, hit, cross)]
    slower = lambda xs, ys: sum(x > y for x, y in zip(xs, ys)) / len(xs)  # noqa: E731
    assert slower(cold, hit) >= 0.8, (medians, slower(cold, hit))  # the channel exists: a hit is faster
    assert slower(cross, hit) >= 0.8, (medians, slower(cross, hit))  # ... and cross-tenant is no hit
    assert 0.2 <= slower(cross, cold) <= 0.8, (medians, slower(cross, cold))
