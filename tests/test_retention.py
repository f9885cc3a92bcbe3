"""Retained prefixes (kv/retention.py): spared by eviction until their TTL passes since last use,
refreshed by hits, bounded, never in the way of an admission; in the device pool (full attention
and sliding windows) and the host tier; per tenant. A fake clock throughout. No torch."""

from __future__ import annotations

import pytest

from prefixkv.config import CacheConfig, SchedulerConfig
from prefixkv.kv import KVCacheCoordinator, TierConnector
from prefixkv.kv.keys import cache_root, hash_blocks
from prefixkv.kv.retention import RetentionTable
from prefixkv.request import Request, RequestStatus
from prefixkv.sampling_params import SamplingParams
from prefixkv.scheduler import Scheduler

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Run:
    """A scheduler over ``num_blocks`` pages, every request run to its end (one output token)."""

    def __init__(self, num_blocks: int = 16, fraction: float = 0.5, **sched) -> None:
        self.clock = Clock()
        cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, **sched)
        self.s = Scheduler(cfg, CacheConfig(block_size=BS, max_retained_fraction=fraction), num_blocks,
                           clock=self.clock)
        self.kv = self.s.kv
        self.n = 0
        self.steps: list = []

    def request(self, tokens: list[int], **params) -> Request:
        self.n += 1
        params.setdefault("max_tokens", 1)
        req = Request(f"r{self.n}", tokens, SamplingParams(temperature=0.0, **params), self.n, 0)
        self.s.add_request(req)
        return req

    def run(self, *prompts: list[int], **params) -> list[Request]:
        reqs = [self.request(p, **params) for p in prompts]
        while self.s.has_unfinished():
            self.step()
        return reqs

    def step(self):
        """A step; requests that reached their max_tokens finish (the engine's part)."""
        out = self.s.schedule()
        for req in self.s.update(out, [[7] if x.num_samples else [] for x in out.scheduled]):
            if req.num_output_tokens >= req.sampling_params.max_tokens:
                self.s.finish_request(req, RequestStatus.FINISHED_LENGTH)
        self.s.check_integrity()
        return out

    def flood(self, base: int, num: int = 8, blocks: int = 3) -> None:
        """Distinct prompts, one at a time: together they fill the pool many times over."""
        for i in range(num):
            self.run([base + i * 100 + t for t in range(blocks * BS)])

    def cached(self, tokens: list[int], **params) -> int:
        """Tokens of ``tokens`` the device pool holds (no touch)."""
        root = cache_root(params.get("cache_salt"), params.get("cache_partition"))
        return self.kv.match_prefix(tokens + [0], touch=False, root=root).num_tokens


SYSTEM = list(range(1000, 1000 + 2 * BS))  # two blocks


def test_retained_prefix_survives_a_flood_then_lapses_after_its_ttl():
    r = Run()
    r.run(SYSTEM + [1, 2], kv_retention_ttl_s=60.0)
    assert r.cached(SYSTEM) == 2 * BS and r.kv.retention.num_blocks == 2
    r.flood(10_000)
    assert r.cached(SYSTEM) == 2 * BS  # everything else went: the flood's first prompts too
    assert r.cached([10_000 + t for t in range(3 * BS)]) == 0
    r.clock.now = 59.0
    r.flood(20_000)
    assert r.cached(SYSTEM) == 2 * BS
    r.clock.now = 61.0  # 61 s since its last use
    r.flood(30_000)
    assert r.cached(SYSTEM) == 0
    assert r.kv.retention.num_expired == 1 and r.kv.retention.num_blocks == 0 and r.kv.retention.num_evicted == 0


def test_without_retention_the_flood_evicts_it():
    r = Run()
    r.run(SYSTEM + [1, 2])
    r.flood(10_000)
    assert r.cached(SYSTEM) == 0


def test_a_hit_refreshes_the_ttl():
    r = Run()
    r.run(SYSTEM + [1, 2], kv_retention_ttl_s=10.0)
    r.clock.now = 8.0
    (hit,) = r.run(SYSTEM + [3, 4, 5])  # no retention asked: its hit on the prefix refreshes it
    assert hit.num_cached_tokens == 2 * BS
    r.clock.now = 15.0  # 15 s after the retention, 7 s after the hit
    r.flood(10_000)
    assert r.cached(SYSTEM) == 2 * BS
    r.clock.now = 18.5
    r.flood(20_000)
    assert r.cached(SYSTEM) == 0


def test_a_hit_on_part_of_the_prefix_does_not_refresh_it():
    r = Run()
    r.run(SYSTEM + [1, 2], kv_retention_ttl_s=10.0)
    r.clock.now = 8.0
    (hit,) = r.run(SYSTEM[:BS] + [5, 5, 5, 5, 5])  # the first block only
    assert hit.num_cached_tokens == BS
    r.clock.now = 15.0
    r.flood(10_000)
    assert r.cached(SYSTEM) == 0


def test_a_block_aligned_prompt_asked_again_refreshes_its_retention():
    r = Run()
    r.run(SYSTEM, kv_retention_ttl_s=10.0)  # 8 tokens: both blocks retained
    r.clock.now = 8.0
    (again,) = r.run(SYSTEM)  # hits one block (the last token is computed) and covers both
    assert again.num_cached_tokens == BS
    r.clock.now = 15.0
    r.flood(10_000)
    assert r.cached(SYSTEM) == 2 * BS


def test_kv_retention_tokens_retains_only_that_prefix():
    r = Run()
    r.run(SYSTEM + list(range(50, 50 + 2 * BS)) + [1], kv_retention_ttl_s=60.0, kv_retention_tokens=2 * BS + 3)
    assert r.kv.retention.num_blocks == 2  # whole blocks of the first 11 tokens
    r.flood(10_000)
    assert r.cached(SYSTEM + list(range(50, 50 + 2 * BS))) == 2 * BS


def test_the_bound_lapses_the_oldest_retention_first_and_counts_it():
    r = Run(num_blocks=16, fraction=0.25)  # at most 4 blocks retained
    assert r.kv.retention.max_blocks == 4
    a, b, c = ([k * 100 + t for t in range(2 * BS)] for k in (1, 2, 3))
    r.run(a + [9], kv_retention_ttl_s=60.0)
    r.clock.now = 1.0
    r.run(b + [9], kv_retention_ttl_s=60.0)
    r.clock.now = 2.0
    r.run(a + [8], kv_retention_ttl_s=60.0)  # a again: now b is the oldest
    r.clock.now = 3.0
    r.run(c + [9], kv_retention_ttl_s=60.0)
    assert r.kv.retention.num_lapsed == 1 and r.kv.retention.num_blocks == 4
    r.flood(10_000)
    assert (r.cached(a), r.cached(b), r.cached(c)) == (2 * BS, 0, 2 * BS)


def test_a_prefix_longer_than_the_bound_keeps_its_first_blocks():
    r = Run(num_blocks=16, fraction=0.25)
    long = list(range(500, 500 + 6 * BS))
    r.run(long + [1], kv_retention_ttl_s=60.0)
    assert r.kv.retention.num_blocks == 4 and r.kv.retention.num_lapsed == 0
    r.flood(10_000)
    assert r.cached(long) == 4 * BS


def test_admission_never_fails_because_of_retention():
    """Every evictable page retained, and a request that needs the whole pool: admitted in its
    first step, as without retention; the retained pages it took are counted."""
    for retained in (False, True):
        r = Run(num_blocks=8, fraction=1.0)
        params = {"kv_retention_ttl_s": 1e4} if retained else {}
        r.run(list(range(100, 100 + 3 * BS)) + [1], **params)
        r.run(list(range(200, 200 + 3 * BS)) + [1], **params)
        assert r.kv.pool.num_evictable == 6 and r.kv.retention.num_blocks == (6 if retained else 0)
        big = r.request(list(range(300, 300 + 8 * BS - 1)))  # 8 pages: the whole pool
        out = r.step()
        assert [x.req for x in out.scheduled] == [big] and not out.out_of_memory and not out.preempted
        assert r.kv.retention.num_evicted == (6 if retained else 0)


def test_a_running_request_is_not_preempted_because_of_retention():
    r = Run(num_blocks=8, fraction=1.0)
    r.run(list(range(100, 100 + 4 * BS)) + [1], kv_retention_ttl_s=1e4)  # 4 pages retained
    long = r.request(list(range(300, 300 + 3 * BS)), max_tokens=5 * BS)  # it grows into the retained pages
    while r.s.has_unfinished():
        out = r.step()
        assert not out.preempted and not out.out_of_memory
    assert long.num_output_tokens == 5 * BS and r.kv.retention.num_evicted > 0


def test_retained_pages_go_after_every_other_one():
    kv = KVCacheCoordinator(num_blocks=8, block_size=BS, clock=Clock())
    for seq, base in (("a", 100), ("b", 200)):
        tokens = list(range(base, base + 2 * BS))
        kv.allocate_slots(seq, 0, len(tokens))
        kv.cache_blocks(seq, tokens, len(tokens))
        kv.free(seq)
    a_pages = kv.match_prefix(list(range(100, 100 + 2 * BS)) + [0], touch=False).blocks[0]
    kv.retain(list(range(100, 100 + 2 * BS)), 2 * BS, 60.0)  # a's blocks: the older ones
    assert kv.evict(2) not in (a_pages, a_pages[::-1])
    assert kv.retention.num_evicted == 0
    assert sorted(kv.evict(8)) == sorted(a_pages) and kv.retention.num_evicted == 2
    kv.check_integrity()


def test_salted_retention_stays_in_its_salts_subtree():
    r = Run()
    r.run(SYSTEM + [1], kv_retention_ttl_s=60.0, cache_salt="tenant-a")
    root = cache_root("tenant-a")
    assert set(r.kv.retention.blocks) == set(hash_blocks(SYSTEM, [], 2, BS, root))
    assert not set(r.kv.retention.blocks) & set(hash_blocks(SYSTEM, [], 2, BS, 0))
    r.run(SYSTEM + [2], cache_salt="tenant-b")  # the same tokens under another salt: other blocks
    r.flood(10_000)
    assert r.cached(SYSTEM, cache_salt="tenant-a") == 2 * BS
    assert r.cached(SYSTEM, cache_salt="tenant-b") == 0 and r.cached(SYSTEM) == 0
    (b,) = r.run(SYSTEM + [3], cache_salt="tenant-b")
    assert b.num_cached_tokens == 0


def test_sliding_window_groups_keep_a_retained_prefix_too():
    clock = Clock()
    kv = KVCacheCoordinator(num_blocks=24, block_size=BS, windows=(None, 2 * BS), clock=clock)
    prefix = list(range(100, 100 + 3 * BS))

    def run(seq: str, tokens: list[int]) -> int:
        m = kv.match_prefix(tokens, lower=True)
        assert kv.allocate_slots(seq, m.num_tokens, len(tokens) - m.num_tokens, prefix=m) is not None
        kv.cache_blocks(seq, tokens, len(tokens))
        kv.free(seq)
        kv.check_integrity()
        return m.num_tokens

    run("p", prefix + [1])
    kv.retain(prefix, len(prefix), 30.0)
    for i in range(10):
        run(f"f{i}", [10_000 + i * 100 + t for t in range(4 * BS)])
    assert run("again", prefix + [2]) == 3 * BS
    clock.now = 100.0
    for i in range(10):
        run(f"g{i}", [20_000 + i * 100 + t for t in range(4 * BS)])
    assert run("late", prefix + [3]) == 0


def test_host_tier_keeps_a_retained_block_until_its_ttl():
    clock = Clock()
    tiers = TierConnector(num_host_pages=4)
    kv = KVCacheCoordinator(num_blocks=6, block_size=BS, lower=tiers, max_retained_fraction=1.0, clock=clock)
    prefix = list(range(100, 100 + 2 * BS))

    def run(seq: str, tokens: list[int]) -> tuple[int, int]:
        m = kv.match_prefix(tokens, lower=True)
        assert kv.allocate_slots(seq, m.num_tokens, len(tokens) - m.num_tokens, prefix=m) is not None
        kv.cache_blocks(seq, tokens, len(tokens))
        tiers.take_plan([])
        tiers.begin_step(False)
        kv.free(seq)
        kv.check_integrity()
        return m.num_tokens, len({r.index for r in m.lower})

    run("p", prefix + [1])
    kv.retain(prefix, len(prefix), 30.0)
    run("big", list(range(500, 500 + 6 * BS - 1)))  # the whole pool: the retained pages go to the host tier
    assert kv.retention.num_evicted == 2
    for i in range(6):  # unretained pages churn the host tier (4 slots) many times over
        run(f"f{i}", [10_000 + i * 100 + t for t in range(6 * BS - 1)])
    assert tiers.host.num_retained_pushed_out == 0
    assert run("again", prefix + [2]) == (2 * BS, 2)  # from the host tier
    kv.retain(prefix, len(prefix), 30.0)  # (the hit refreshed it: this is what the scheduler does at admission)
    run("big2", list(range(600, 600 + 6 * BS - 1)))
    clock.now = 100.0
    for i in range(6):
        run(f"g{i}", [20_000 + i * 100 + t for t in range(6 * BS - 1)])
    assert run("late", prefix + [3]) == (0, 0)


def test_retention_table_bound_refresh_release_and_expiry():
    clock = Clock()
    t = RetentionTable(max_blocks=3, clock=clock)
    t.retain([1, 2], 10.0)
    clock.now = 1.0
    t.retain([1, 2, 3], 5.0)  # shares blocks 1 and 2
    assert t.blocks == {1: 2, 2: 2, 3: 1} and list(t.prefixes) == [2, 3]
    clock.now = 2.0
    t.retain([1, 2], 1.0)  # asked again: refreshed, keeps its longer TTL, now the newest
    assert list(t.prefixes) == [3, 2] and t.prefixes[2].ttl_s == 10.0
    t.retain([9], 10.0)  # a 4th block: the oldest ([1, 2, 3]) lapses
    assert t.num_lapsed == 1 and t.blocks == {1: 1, 2: 1, 9: 1} and list(t.prefixes) == [2, 9]
    t.check_integrity()
    clock.now = 5.0
    t.touch([5, 9])  # a hit covering [9] (and part of nothing else)
    assert list(t.prefixes) == [2, 9]
    clock.now = 12.5  # [1, 2]: 10.5 s since its last use; [9]: 7.5 s
    t.expire()
    assert list(t.prefixes) == [9] and t.num_expired == 1 and t.blocks == {9: 1}
    clock.now = 15.5
    t.expire()
    assert not t.prefixes and t.num_expired == 2 and t.blocks == {}
    t.retain([4, 5], 10.0, "h")
    assert not t.release("g") and t.release("h") and t.blocks == {} and t.handles == {}
    t.check_integrity()
    with pytest.raises(ValueError, match="max_blocks"):
        RetentionTable(-1)


def test_retention_fields_cross_the_engine_process_boundary_and_are_checked():
    import argparse

    from prefixkv.engine_args import EngineArgs, add_engine_args
    from prefixkv.engine_core.messages import params_from_wire, params_to_wire

    p = SamplingParams(kv_retention_ttl_s=60.0, kv_retention_tokens=32, cache_salt="s")
    assert params_from_wire(params_to_wire(p)) == p
    for kw, field in ((dict(kv_retention_ttl_s=0), "kv_retention_ttl_s"),
                      (dict(kv_retention_ttl_s=float("nan")), "kv_retention_ttl_s"),
                      (dict(kv_retention_ttl_s=True), "kv_retention_ttl_s"),
                      (dict(kv_retention_ttl_s=10, kv_retention_tokens=0), "kv_retention_tokens"),
                      (dict(kv_retention_tokens=8), "kv_retention_tokens")):
        with pytest.raises(ValueError, match=f"^{field}:"):
            SamplingParams(**kw)
    for bad in (-0.1, 1.5, True):
        with pytest.raises(ValueError, match="^max_retained_fraction:"):
            CacheConfig(max_retained_fraction=bad)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--max-retained-fraction", "0.25"])
    assert EngineArgs.from_cli_args(args).create_engine_config().cache.max_retained_fraction == 0.25


def test_a_handle_releases_its_retention_and_only_its_own():
    """Two handles on one prefix (two stored responses with the same prompt), a longer prefix over
    it (a continuation), a prefix also asked for without a handle: each release lets go of its
    own hold; blocks another retained prefix covers stay retained."""
    t = RetentionTable(max_blocks=8, clock=Clock())
    t.retain([1, 2], 10.0, "a")
    t.retain([1, 2], 10.0, "b")
    t.retain([1, 2, 3], 10.0, "c")
    assert t.prefixes[2].holders == {"a", "b"} and t.handles == {"a": 2, "b": 2, "c": 3}
    assert t.release("a") and not t.release("a")
    assert list(t.prefixes) == [2, 3] and t.blocks == {1: 2, 2: 2, 3: 1}  # b still holds [1, 2]
    assert t.release("b")
    assert list(t.prefixes) == [3] and t.blocks == {1: 1, 2: 1, 3: 1}  # the continuation covers them
    t.check_integrity()
    assert t.release("c") and t.blocks == {} and t.handles == {}
    t.retain([4, 5], 10.0)
    t.retain([4, 5], 10.0, "d")  # also asked for without a handle: that ask lapses with the TTL only
    assert t.release("d") and t.blocks == {4: 1, 5: 1} and not t.prefixes[5].holders
    t.retain([6], 10.0, "e")
    t.retain([7], 10.0, "e")  # the handle moves: [6], held by nothing else, goes
    assert 6 not in t.blocks and t.handles == {"e": 7}
    t.check_integrity()
    t.clock.now = 11.0
    t.expire()  # everything expired: the handles name nothing
    assert not t.prefixes and t.handles == {} and not t.release("e")
    t.check_integrity()


def test_released_prefix_goes_in_the_next_flood_a_continuation_keeps_its_part():
    """Through the scheduler: a conversation's first turn retained under "r1", its continuation
    (the first turn's prompt and more) under "r2". Releasing r1 keeps what r2 covers; releasing r2
    lets the flood take it; a released handle releases nothing twice."""
    r = Run(num_blocks=24)
    first = SYSTEM + [1, 2, 3, 4]  # 3 full blocks
    r.run(first + [5], kv_retention_ttl_s=600.0, kv_retention_handle="r1")
    r.run(first + [5, 6, 7, 8, 9, 10, 11, 12, 13], kv_retention_ttl_s=600.0, kv_retention_handle="r2")
    assert r.kv.retention.num_blocks == 5
    assert r.kv.release_retention("r1") and not r.kv.release_retention("r1")
    r.flood(10_000, num=10)
    assert r.cached(first + [5, 6, 7, 8, 9, 10, 11, 12]) == 5 * BS
    assert r.kv.release_retention("r2") and r.kv.retention.num_blocks == 0
    r.flood(20_000, num=10)
    assert r.cached(first) == 0


def test_a_released_retention_is_evicted_by_recency_like_any_block():
    r = Run()
    r.run(SYSTEM + [1], kv_retention_ttl_s=600.0, kv_retention_handle="resp_1")
    r.flood(10_000)
    assert r.cached(SYSTEM) == 2 * BS
    assert r.kv.release_retention("resp_1")
    r.flood(20_000)
    assert r.cached(SYSTEM) == 0 and r.kv.retention.num_expired == 0


def test_a_retention_handle_is_a_non_empty_string_with_a_ttl():
    for kw, field in ((dict(kv_retention_ttl_s=5, kv_retention_handle=""), "kv_retention_handle"),
                      (dict(kv_retention_ttl_s=5, kv_retention_handle=3), "kv_retention_handle"),
                      (dict(kv_retention_handle="h"), "kv_retention_handle")):
        with pytest.raises(ValueError, match=f"^{field}:"):
            SamplingParams(**kw)
