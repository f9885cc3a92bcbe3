"""Block pool, radix index, KV manager and scheduler: exact block ids, ref counts, eviction order,
copy-on-write ops, and check_integrity() after every step of a randomized run. No torch."""

from __future__ import annotations

import random

import pytest

from prefixkv.config import CacheConfig, SchedulerConfig
from prefixkv.kv import BlockPool, CopyOp, KVCacheCoordinator, RadixIndex
from prefixkv.request import Request, RequestStatus
from prefixkv.sampling_params import SamplingParams
from prefixkv.scheduler import Scheduler


def test_block_pool_states():
    pool = BlockPool(4)
    a, b = pool.allocate(), pool.allocate()
    assert (a, b) == (0, 1) and pool.ref_cnt.tolist() == [1, 1, 0, 0]
    pool.incref(a)
    pool.pin(b)  # the radix index takes b
    assert pool.ref_cnt.tolist() == [2, 2, 0, 0] and pool.num_evictable == 0
    pool.decref(b)
    assert pool.num_evictable == 1 and pool.num_in_use == 1 and pool.num_free == 2
    pool.decref(a), pool.decref(a)
    assert list(pool.free_ids) == [2, 3, 0]
    pool.unpin(b)
    assert list(pool.free_ids) == [2, 3, 0, 1] and pool.num_evictable == 0
    pool.check_integrity()
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def _hold(pool: BlockPool, n: int) -> list[int]:
    return [pool.allocate() for _ in range(n)]


def test_radix_match_insert_split_and_lru_eviction():
    pool = BlockPool(8)
    tree = RadixIndex(pool, block_size=2)
    a = _hold(pool, 3)  # [0, 1, 2]
    assert tree.insert([1, 2, 3, 4, 5, 6], (a,)) == 3
    assert pool.ref_cnt[:3].tolist() == [2, 2, 2]
    # a diverging sequence shares the first block, then splits the node
    b = [0] + _hold(pool, 2)  # [0, 3, 4]; block 0 is the tree's
    pool.incref(0)
    assert tree.insert([1, 2, 9, 9, 7, 7], (b,)) == 2
    assert tree.match([1, 2, 3, 4, 5, 6, 8])[:2] == (([0, 1, 2],), 6)
    assert tree.match([1, 2, 9, 9, 7])[:2] == (([0, 3],), 4)  # whole blocks only
    assert tree.match([5, 5])[:2] == (([],), 0)
    tree.check_integrity()
    # requests let go: blocks stay cached, evictable
    for blk in a + b:
        pool.decref(blk)
    assert pool.num_evictable == 5 and pool.num_free == 3
    tree.match([1, 2, 9, 9])  # touch the second branch: the first becomes least recently used
    assert tree.evict(2) == [2, 1]  # LRU leaf, from its tail block up
    assert tree.evict(10) == [4, 3, 0]
    assert tree.match([1, 2])[:2] == (([],), 0)
    tree.check_integrity()
    pool.check_integrity()


def test_radix_never_evicts_locked_blocks_and_keeps_its_own_duplicate():
    pool = BlockPool(6)
    tree = RadixIndex(pool, block_size=2)
    a = _hold(pool, 2)
    tree.insert([1, 2, 3, 4], (a,))
    dup = _hold(pool, 2)  # another request computed the same tokens into its own blocks
    assert tree.insert([1, 2, 3, 4], (dup,)) == 0
    assert tree.match([1, 2, 3, 4])[:2] == (([0, 1],), 4)
    assert tree.evict(4) == []  # a still holds 0 and 1
    pool.decref(a[1])
    assert tree.evict(4) == [1]  # the tail is free to go; block 0 stays locked
    tree.check_integrity()


def test_manager_allocate_match_free_exact_ids():
    kv = KVCacheCoordinator(num_blocks=6, block_size=4)
    prompt = list(range(10, 20))  # 10 tokens -> 3 blocks
    assert kv.allocate_slots("a", 0, 10) == []
    assert kv.block_tables["a"] == ([0, 1, 2],)
    kv.cache_blocks("a", prompt, 10)  # blocks 0 and 1 are full
    assert kv.pool.ref_cnt.tolist() == [2, 2, 1, 0, 0, 0]
    m = kv.match_prefix(prompt + [99])
    assert m[:2] == (([0, 1],), 8)
    assert kv.match_prefix(prompt[:8])[:2] == (([0],), 4)  # the last token is always computed
    assert kv.allocate_slots("b", 8, 3, prefix=m) == []
    assert kv.block_tables["b"] == ([0, 1, 3],) and kv.pool.ref_cnt[:4].tolist() == [3, 3, 1, 1]
    kv.check_integrity()
    kv.free("a")
    kv.free("b")
    assert kv.pool.ref_cnt.tolist() == [1, 1, 0, 0, 0, 0] and kv.num_used_blocks == 0
    assert list(kv.pool.free_ids) == [4, 5, 2, 3]  # a freed before b; each table tail first
    kv.check_integrity()


def test_manager_allocation_failure_changes_nothing():
    kv = KVCacheCoordinator(num_blocks=3, block_size=4)
    assert kv.allocate_slots("a", 0, 8) == []
    assert kv.allocate_slots("b", 0, 8) is None
    assert "b" not in kv.block_tables and kv.pool.ref_cnt.tolist() == [1, 1, 0]
    kv.check_integrity()


def test_fork_shares_partial_block_and_copies_on_first_write():
    kv = KVCacheCoordinator(num_blocks=8, block_size=4)
    kv.allocate_slots("p", 0, 6)  # blocks [0, 1]; block 1 is partial (2 of 4 slots)
    kv.fork("p", "c1")
    kv.fork("p", "c2")
    assert kv.pool.ref_cnt[:2].tolist() == [3, 3]
    # each sequence's next token goes into the shared partial block: copy-on-write
    assert kv.allocate_slots("c1", 6, 1) == [CopyOp(1, 2)]
    assert kv.block_tables["c1"] == ([0, 2],)
    assert kv.allocate_slots("c2", 6, 1) == [CopyOp(1, 3)]
    assert kv.allocate_slots("p", 6, 1) == []  # the last holder writes in place
    assert kv.block_tables == {"p": ([0, 1],), "c1": ([0, 2],), "c2": ([0, 3],)}
    assert kv.pool.ref_cnt[:4].tolist() == [3, 1, 1, 1]
    kv.check_integrity()
    for s in ("p", "c1", "c2"):
        kv.free(s)
    assert kv.num_used_blocks == 0
    kv.check_integrity()


def _req(i: int, tokens: list[int], max_tokens: int = 4, n: int = 1) -> Request:
    return Request(f"r{i}", tokens, SamplingParams(max_tokens=max_tokens, n=n, temperature=0.0), i, 0)


def _sched(num_blocks: int, block_size: int = 4, budget: int = 16, max_seqs: int = 8, **kw) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, **kw),
                     CacheConfig(block_size=block_size), num_blocks)


def test_scheduler_chunks_prefill_and_mixes_decodes():
    s = _sched(num_blocks=16, budget=8)
    a, b = _req(0, list(range(1, 11))), _req(1, list(range(50, 53)))
    s.add_request(a)
    out = s.schedule()
    assert [(x.req.seq_id, x.num_computed_tokens, x.num_scheduled_tokens, x.num_samples) for x in out.scheduled] == [("r0#0", 0, 8, 0)]
    # the step's inputs as copies: its query tokens, its whole new table
    assert [(x.token_ids, x.block_delta) for x in out.scheduled] == [(list(range(1, 9)), (0, ([0, 1],)))]
    s.update(out, [[]])
    s.add_request(b)
    out = s.schedule()  # a's last 2 prompt tokens, then b's whole prompt
    assert [(x.req.seq_id, x.num_computed_tokens, x.num_scheduled_tokens, x.num_samples) for x in out.scheduled] == [
        ("r0#0", 8, 2, 1), ("r1#0", 0, 3, 1)]
    # only what changed: a's third block, b's whole table
    assert [(x.token_ids, x.block_delta) for x in out.scheduled] == [([9, 10], (2, ([2],))), ([50, 51, 52], (0, ([3],)))]
    s.update(out, [[7], [9]])
    out = s.schedule()  # both decode, each into room left in its last block: no table changed
    assert out.num_decodes == 2 and out.num_batched_tokens == 2
    assert [(x.token_ids, x.block_delta) for x in out.scheduled] == [([7], None), ([9], None)]
    assert s.kv.block_tables == {"r0#0": ([0, 1, 2],), "r1#0": ([3],)}
    s.update(out, [[8], [11]])
    out = s.schedule()  # b's decode starts its second block
    assert [(x.token_ids, x.block_delta) for x in out.scheduled] == [([8], None), ([11], (1, ([4],)))]
    s.check_integrity()


def test_max_admitted_prefill_tokens_spreads_a_burst_of_short_prefills():
    """Four returning turns of 5 new tokens each arrive together: by default all four prefill in
    one step; with max_admitted_prefill_tokens=4 one is admitted a step (the first whatever its
    size), beside the decodes of those before it. Past the cap, a prompt that would only start a
    chunked prefill in this step is still admitted with the budget left; one that would finish
    waits for the next step."""
    def burst(**kw):
        s = _sched(num_blocks=64, block_size=4, budget=32, **kw)
        for i in range(4):
            s.add_request(_req(i, [10 * i + t for t in range(1, 6)]))
        steps = []
        for _ in range(4):
            out = s.schedule()
            steps.append([(x.req.seq_id, x.num_scheduled_tokens) for x in out.scheduled])
            s.update(out, [[99] if x.num_samples else [] for x in out.scheduled])
            s.check_integrity()
        return s, steps

    _, steps = burst(max_admitted_prefill_tokens=None)
    assert steps[0] == [("r0#0", 5), ("r1#0", 5), ("r2#0", 5), ("r3#0", 5)]
    s, steps = burst(max_admitted_prefill_tokens=4)
    assert steps == [[("r0#0", 5)],
                     [("r0#0", 1), ("r1#0", 5)],
                     [("r0#0", 1), ("r1#0", 1), ("r2#0", 5)],
                     [("r0#0", 1), ("r1#0", 1), ("r2#0", 1), ("r3#0", 5)]]
    s.add_request(_req(8, list(range(200, 209))))   # 9 tokens: admitted first (4 cap reached)
    s.add_request(_req(9, list(range(300, 340))))   # 40 tokens: only a chunk fits -> admitted
    s.add_request(_req(10, [7, 8, 9]))              # would finish its prefill here -> next step
    out = s.schedule()
    assert [(x.req.seq_id, x.num_scheduled_tokens) for x in out.scheduled] == [
        ("r0#0", 1), ("r1#0", 1), ("r2#0", 1), ("r3#0", 1), ("r8#0", 9), ("r9#0", 19)]
    assert [r.seq_id for r in s.waiting] == ["r10#0"]
    s.update(out, [[99]] * 5 + [[]])
    for x in out.scheduled[:4]:
        s.finish_request(x.req, RequestStatus.FINISHED_STOPPED)
    out = s.schedule()  # r9's prefill goes on; r10 is this step's first admission
    assert [(x.req.seq_id, x.num_scheduled_tokens) for x in out.scheduled] == [
        ("r8#0", 1), ("r9#0", 21), ("r10#0", 3)]
    s.check_integrity()


def test_auto_admission_cap_doubles_while_it_holds_requests_back():
    """max_admitted_prefill_tokens="auto" (the default): a step admits short prefills until 16 of
    their tokens are scheduled; each step that held one back doubles that (at most the token
    budget) until a step's pass gets through the queue, which sets it to 16 again. Twelve turns of 5
    new tokens come in 4 + 7 + 1 over three steps (a fixed cap of 16: 4 + 4 + 4), the next burst
    starts at 16 again. A pass stopped by the token budget keeps the cap (a burst larger than a
    step's budget is not throttled back to 16 between its steps); a queue emptied by aborts resets
    it."""
    s = _sched(num_blocks=256, block_size=4, budget=100, max_seqs=64)
    assert s.config.max_admitted_prefill_tokens == "auto"

    def step():
        cap = s.admission_cap
        out = s.schedule()
        s.update(out, [[99] if x.num_samples else [] for x in out.scheduled])
        s.check_integrity()
        return cap, [x.req.seq_id for x in out.scheduled if x.num_computed_tokens == 0]

    for i in range(12):
        s.add_request(_req(i, [100 * i + t for t in range(1, 6)], max_tokens=20))
    assert step() == (16, ["r0#0", "r1#0", "r2#0", "r3#0"])  # 15 < 16 admits the fourth
    assert step() == (32, [f"r{i}#0" for i in range(4, 11)])  # 30 < 32 admits the seventh
    assert step() == (64, ["r11#0"])  # nobody held back
    assert step() == (16, [])
    for i in range(12, 24):
        s.add_request(_req(i, [100 * i + t for t in range(1, 6)], max_tokens=20))
    assert step() == (16, [f"r{i}#0" for i in range(12, 16)])
    assert step() == (32, [f"r{i}#0" for i in range(16, 23)])
    s.add_request(_req(24, [2400 + t for t in range(1, 6)], max_tokens=20))
    assert step() == (64, ["r23#0", "r24#0"])
    # 40 turns against a budget of 40 tokens that the decodes take more of each step: from the
    # second step the budget stops each pass before the cap does, so the cap stays 32 until the
    # pass that admits the last of them
    s2 = _sched(num_blocks=512, block_size=4, budget=40, max_seqs=64)
    for i in range(40):
        s2.add_request(_req(i, [100 * i + t for t in range(1, 6)], max_tokens=50))
    caps = []
    while s2.waiting:
        caps.append(s2.admission_cap)
        out = s2.schedule()
        s2.update(out, [[99] if x.num_samples else [] for x in out.scheduled])
        s2.check_integrity()
    assert caps == [16] + [32] * 15 and s2.admission_cap == 16
    # a burst held back, then aborted while it waits: the next step starts from 16
    s3 = _sched(num_blocks=256, block_size=4, budget=100, max_seqs=64)
    for i in range(12):
        s3.add_request(_req(i, [100 * i + t for t in range(1, 6)], max_tokens=20))
    s3.update(s3.schedule(), [[99]] * 4)
    assert s3.admission_cap == 32
    for r in list(s3.waiting):
        s3.finish_request(r, RequestStatus.FINISHED_ABORTED)
    s3.update(s3.schedule(), [[99]] * 4)
    assert s3.admission_cap == 16


def test_auto_admission_cap_is_none_on_cuda_and_with_the_static_policy():
    cfg = SchedulerConfig()
    assert cfg.for_device("cpu") is cfg
    assert cfg.for_device("cuda").max_admitted_prefill_tokens is None
    assert SchedulerConfig(max_admitted_prefill_tokens=32).for_device("cuda").max_admitted_prefill_tokens == 32
    assert _sched(num_blocks=8).admission_cap == 16
    assert _sched(num_blocks=8, max_admitted_prefill_tokens=None).admission_cap is None
    assert _sched(num_blocks=8, policy="static").admission_cap is None


@pytest.mark.parametrize("bad", [0, -3, 2.5, "8", True, "none"])
def test_bad_max_admitted_prefill_tokens(bad):
    with pytest.raises(ValueError, match="max_admitted_prefill_tokens"):
        SchedulerConfig(max_admitted_prefill_tokens=bad)


def test_max_admitted_prefill_tokens_needs_the_continuous_policy():
    with pytest.raises(ValueError, match="max_admitted_prefill_tokens"):
        SchedulerConfig(policy="static", max_admitted_prefill_tokens=4)


def test_max_admitted_prefill_tokens_cli_flag():
    import argparse

    from prefixkv.engine_args import add_engine_args, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args([])).scheduler.max_admitted_prefill_tokens == "auto"
    for flag, value in [("32", 32), ("auto", "auto"), ("none", None)]:
        cfg = engine_config_from_args(p.parse_args(["--max-admitted-prefill-tokens", flag]))
        assert cfg.scheduler.max_admitted_prefill_tokens == value
    with pytest.raises(ValueError, match="max_admitted_prefill_tokens"):
        engine_config_from_args(p.parse_args(["--max-admitted-prefill-tokens", "0"]))
    with pytest.raises(SystemExit):
        p.parse_args(["--max-admitted-prefill-tokens", "lots"])


def test_scheduler_preempts_youngest_and_requeues_it_first():
    s = _sched(num_blocks=4, block_size=4, budget=64)
    a, b = _req(0, list(range(1, 8))), _req(1, list(range(20, 27)))  # 7 tokens: 2 blocks each
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    s.update(out, [[100], [200]])
    out = s.schedule()  # 8 tokens each: still 2 blocks
    s.update(out, [[101], [201]])
    out = s.schedule()  # a needs a third block: none free, so b (youngest) is preempted
    assert out.preempted == [b] and [x.req for x in out.scheduled] == [a]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and s.waiting[0] is b
    assert b.token_ids[-2:].tolist() == [200, 201]  # its outputs are kept and will be recomputed
    s.check_integrity()


def test_scheduler_cache_aware_order_with_aging():
    s = _sched(num_blocks=32, block_size=4, budget=12, max_wait_steps=2)
    warm = _req(0, list(range(1, 13)))
    s.add_request(warm)
    s.update(s.schedule(), [[5]])
    s.finish_request(warm, RequestStatus.FINISHED_STOPPED)
    cold = _req(1, list(range(100, 110)))
    hot = _req(2, list(range(1, 13)) + [7, 7])  # shares 12 cached tokens
    s.add_request(cold)
    s.add_request(hot)
    out = s.schedule()
    assert [x.req.seq_id for x in out.scheduled][0] == "r2#0"  # longest cached prefix first
    assert hot.num_cached_tokens == 12
    # aging: a request passed over max_wait_steps times goes ahead of better-cached ones
    s2 = _sched(num_blocks=32, block_size=4, budget=4, max_seqs=1, max_wait_steps=2)
    old = _req(0, [1, 2, 3])
    s2.add_request(old)
    s2.waiting[0].wait_start_step = -2  # passed over twice already
    s2.add_request(_req(1, [1, 2, 3, 4, 5]))
    assert s2.schedule().scheduled[0].req is old


def test_scheduler_max_wait_steps_0_admits_in_arrival_order():
    """``max_wait_steps=0``: no cache-aware reordering; the same queue as above, the cold request
    first, then the hot one (still starting from its 12 cached tokens)."""
    s = _sched(num_blocks=32, block_size=4, budget=12, max_seqs=1, max_wait_steps=0)
    warm = _req(0, list(range(1, 13)))
    s.add_request(warm)
    s.update(s.schedule(), [[5]])
    s.finish_request(warm, RequestStatus.FINISHED_STOPPED)
    cold, hot = _req(1, list(range(100, 110))), _req(2, list(range(1, 13)) + [7, 7])
    s.add_request(cold)
    s.add_request(hot)
    out = s.schedule()
    assert [(x.req.seq_id, x.num_computed_tokens) for x in out.scheduled] == [("r1#0", 0)]
    s.update(out, [[9]])
    s.finish_request(cold, RequestStatus.FINISHED_STOPPED)
    out = s.schedule()
    assert [(x.req.seq_id, x.num_computed_tokens, x.num_scheduled_tokens) for x in out.scheduled] == [("r2#0", 12, 2)]
    s.check_integrity()


def test_scheduler_n_forks_share_prompt_blocks():
    s = _sched(num_blocks=16, block_size=4, budget=32)
    r = _req(0, list(range(1, 7)), n=3)  # 6 tokens: one full block + a partial one
    s.add_request(r)
    out = s.schedule()
    assert out.scheduled[0].num_samples == 3
    changed = s.update(out, [[11, 12, 13]])
    assert sorted(c.seq_id for c in changed) == ["r0#0", "r0#1", "r0#2"]
    assert s.kv.block_tables == {"r0#0": ([0, 1],), "r0#1": ([0, 1],), "r0#2": ([0, 1],)}
    assert s.kv.pool.ref_cnt[:2].tolist() == [4, 3]  # block 0 is also in the radix tree
    out = s.schedule()
    assert out.copy_ops == [CopyOp(1, 2), CopyOp(1, 3)]
    s.check_integrity()


def test_randomized_run_keeps_integrity_and_leaks_nothing():
    rng = random.Random(0)
    s = _sched(num_blocks=14, block_size=4, budget=20, max_seqs=6)
    next_id = 0
    for step in range(400):
        if rng.random() < 0.5 and next_id < 80:
            base = [1, 2, 3, 4, 5, 6, 7, 8] if rng.random() < 0.5 else []
            req = _req(next_id, base + [rng.randrange(10, 50) for _ in range(rng.randrange(1, 20))],
                       max_tokens=rng.randrange(1, 20), n=rng.choice([1, 1, 2]))
            next_id += 1
            s.add_request(req)
        if s.requests and rng.random() < 0.05:
            victim = rng.choice(list(s.requests.values()))
            s.finish_request(victim, RequestStatus.FINISHED_ABORTED)
        out = s.schedule()
        sampled = [[rng.randrange(10, 50) for _ in range(x.num_samples)] for x in out.scheduled]
        for req in s.update(out, sampled):
            if req.num_output_tokens >= req.sampling_params.max_tokens:
                s.finish_request(req, RequestStatus.FINISHED_LENGTH)
        s.check_integrity()
        # the tree's blocks hold exactly the tokens it claims (checked against each sequence)
        cached = s.kv.cached_blocks()
        for r in s.running:
            (table,) = s.kv.block_tables[r.seq_id]
            for i in range(s.kv.managers[0].num_indexed[r.seq_id]):
                if table[i] in cached:
                    assert cached[table[i]] == tuple(r.token_ids[i * 4:(i + 1) * 4])
    while s.has_unfinished():
        out = s.schedule()
        for req in s.update(out, [[1] * x.num_samples for x in out.scheduled]):
            if req.num_output_tokens >= req.sampling_params.max_tokens:
                s.finish_request(req, RequestStatus.FINISHED_LENGTH)
        s.check_integrity()
    assert s.kv.num_used_blocks == 0
    assert s.num_preemptions > 0


def test_max_num_seqs_counts_the_samples_a_request_will_fork_into():
    s = _sched(num_blocks=64, budget=64, max_seqs=4)
    for i in range(3):
        s.add_request(_req(i, [1 + i, 2, 3, 4, 5], max_tokens=3, n=2))
    peak = 0
    while s.has_unfinished():
        out = s.schedule()
        for req in s.update(out, [[7] * x.num_samples for x in out.scheduled]):
            if req.num_output_tokens >= 3:
                s.finish_request(req, RequestStatus.FINISHED_LENGTH)
        peak = max(peak, s.num_seats, len(s.running))
    assert peak == 4


def test_admission_keeps_the_watermark_free_while_others_run():
    # 10 blocks of 4 tokens, watermark 0.2 -> 2 blocks stay free at admission
    s = _sched(num_blocks=10, block_size=4, budget=64, watermark=0.2, max_admitted_prefill_tokens=None)
    assert s.watermark_blocks == 2
    a, b, c = _req(0, list(range(1, 8))), _req(1, list(range(20, 40))), _req(2, list(range(50, 57)))
    for r in (a, b, c):
        s.add_request(r)
    out = s.schedule()  # a: 2 blocks (8 left), b: 5 blocks (3 left), c would leave 1 < 2
    assert [x.req for x in out.scheduled] == [a, b] and s.waiting == [c]
    assert s.kv.pool.num_free == 3
    s.check_integrity()
    # without a watermark c is admitted in the same situation
    s0 = _sched(num_blocks=10, block_size=4, budget=64, watermark=0.0, max_admitted_prefill_tokens=None)
    for r in (_req(0, list(range(1, 8))), _req(1, list(range(20, 40))), _req(2, list(range(50, 57)))):
        s0.add_request(r)
    assert len(s0.schedule().scheduled) == 3
    # alone, a request is admitted even if it leaves less than the watermark
    s1 = _sched(num_blocks=10, block_size=4, budget=64, watermark=0.5)
    big = _req(0, list(range(1, 33)))  # 8 blocks
    s1.add_request(big)
    assert [x.req for x in s1.schedule().scheduled] == [big]


def test_watermark_counts_cached_blocks_an_admission_locks():
    s = _sched(num_blocks=8, block_size=4, budget=64, watermark=0.25)  # keep 2
    warm = _req(0, list(range(1, 13)))  # 12 tokens -> 3 blocks; cached once computed
    s.add_request(warm)
    s.update(s.schedule(), [[5]])
    s.finish_request(warm, RequestStatus.FINISHED_STOPPED)
    assert s.kv.pool.num_evictable == 3 and s.kv.num_reclaimable_blocks == 8
    runner = _req(1, [90, 91, 92])  # 1 block
    s.add_request(runner)
    s.update(s.schedule(), [[6]])
    # hot matches the 3 cached blocks (locking them) and needs 2 more: 7 - 2 - 3 = 2 >= 2
    hot = _req(2, list(range(1, 13)) + [7] * 5)
    s.add_request(hot)
    assert [x.req for x in s.schedule().scheduled] == [runner, hot]
    # the same request with one block more would leave 1 < 2
    s.finish_request(hot, RequestStatus.FINISHED_ABORTED)
    hot2 = _req(3, list(range(1, 13)) + [7] * 9)
    s.add_request(hot2)
    out = s.schedule()
    assert [x.req for x in out.scheduled] == [runner] and s.waiting == [hot2]


def test_bad_watermark():
    with pytest.raises(ValueError, match="^watermark: "):
        SchedulerConfig(watermark=1.0)


def _radix_with_a_fork():
    """Two sequences sharing two blocks of 2 tokens: node [1 2 3 4] with children [5 6] (its
    request finished) and [9 9] (its request still holds all three blocks)."""
    pool = BlockPool(16)
    radix = RadixIndex(pool, 2)
    a = [pool.allocate() for _ in range(3)]
    radix.insert([1, 2, 3, 4, 5, 6], (a,))
    for b in a:
        pool.decref(b)  # request A finished: the tree alone holds its blocks
    (hit,) = radix.match([1, 2, 3, 4, 9, 9]).blocks
    for b in hit:
        pool.incref(b)
    b2 = pool.allocate()
    radix.insert([1, 2, 3, 4, 9, 9], (hit + [b2],))
    return pool, radix


def test_radix_summary_exact():
    _, radix = _radix_with_a_fork()
    assert radix.clock == 3  # insert, match, insert
    s = radix.summary()
    assert s == {
        "num_nodes": 3, "num_cached_blocks": 4, "num_shown_nodes": 3,
        "root": {"num_children": 1, "children": [
            {"num_tokens": 4, "num_blocks": 2, "num_requests": 1, "age": 0, "num_children": 2, "children": [
                {"num_tokens": 2, "num_blocks": 1, "num_requests": 1, "age": 0, "num_children": 0, "children": []},
                # last used by the match (clock 2), which touched A's whole node before the split
                {"num_tokens": 2, "num_blocks": 1, "num_requests": 0, "age": 1, "num_children": 0, "children": []},
            ]},
        ]},
    }
    assert radix.clock == 3  # a summary is no lookup: LRU time does not move
    with_tokens = radix.summary(max_tokens=3)["root"]["children"][0]
    assert with_tokens["token_ids"] == [1, 2, 3]
    assert [c["token_ids"] for c in with_tokens["children"]] == [[9, 9], [5, 6]]
    cut = radix.summary(max_nodes=2)
    assert cut["num_shown_nodes"] == 2 and cut["root"]["children"][0]["children"][0]["num_requests"] == 1
    assert cut["root"]["children"][0]["num_children"] == 2  # the count says what was cut
    assert radix.summary(max_depth=1)["root"]["children"][0]["children"] == []
    radix.check_integrity()


def test_radix_summary_is_bounded_however_wide_the_tree():
    pool = BlockPool(4096)
    radix = RadixIndex(pool, 4)
    for i in range(1000):  # 1000 runs under the root, run i of (i % 7) + 1 blocks
        n = i % 7 + 1
        radix.insert([10_000 + i] + [7] * (4 * n - 1), ([pool.allocate() for _ in range(n)],))
    s = radix.summary(max_nodes=20, max_children=8)
    shown = s["root"]["children"]
    assert s["num_nodes"] == 1000 and s["root"]["num_children"] == 1000 and len(shown) == 8
    assert s["num_shown_nodes"] == 8
    # the longest runs first, the most recent first among equals: 7-block runs are i = 6, 13, ..., 993
    assert [c["num_blocks"] for c in shown] == [7] * 8
    assert [c["age"] for c in shown] == [999 - i for i in (993, 986, 979, 972, 965, 958, 951, 944)]
    assert len(radix.summary(max_nodes=3)["root"]["children"]) == 3


def test_radix_summary_work_is_bounded_however_wide_the_tree():
    """A root with 5000 children: the summary ranks the SUMMARY_CANDIDATES most recently created,
    so its work does not grow with the tree (counted in visited nodes, not timed)."""
    from prefixkv.kv.radix import SUMMARY_CANDIDATES

    pool = BlockPool(6000)
    radix = RadixIndex(pool, 1)
    for i in range(5000):
        radix.insert([i], ([pool.allocate()],))
    before = radix.num_visits
    s = radix.summary(max_nodes=64)
    assert radix.num_visits - before == SUMMARY_CANDIDATES  # the root's candidates; its children are leaves
    assert s["root"]["num_children"] == 5000 and s["num_shown_nodes"] == 8
    assert [c["age"] for c in s["root"]["children"]] == list(range(8))  # the newest runs, all one block
