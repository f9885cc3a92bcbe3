"""Host-side costs that must not grow with the cache or with a sequence's length. Counted in
operations (nodes visited, matches made), never timed, at two sizes an order of magnitude apart."""

from __future__ import annotations

import pytest

from prefixkv.config import CacheConfig, SchedulerConfig
from prefixkv.kv import KVCacheCoordinator
from prefixkv.kv.block_pool import BlockPool
from prefixkv.kv.radix import RadixIndex
from prefixkv.request import Request, RequestStatus
from prefixkv.sampling_params import SamplingParams
from prefixkv.scheduler import Scheduler

BS = 4


def _tree_with_leaves(num_leaves: int, blocks_per_leaf: int = 3) -> tuple[BlockPool, RadixIndex]:
    """``num_leaves`` distinct cached prompts under one shared first block, all evictable."""
    pool = BlockPool(1 + num_leaves * blocks_per_leaf + 8)
    tree = RadixIndex(pool, BS)
    shared = pool.allocate()
    for i in range(num_leaves):
        blocks = [shared] + [pool.allocate() for _ in range(blocks_per_leaf)]
        pool.incref(shared)
        tokens = [1] * BS + [t for k in range(blocks_per_leaf) for t in (i, k, 7, 9)]
        tree.insert(tokens, (blocks,))
        for b in blocks:
            pool.decref(b)
    pool.decref(shared)
    return pool, tree


def _visits_per_evict(num_leaves: int, calls: int = 50) -> float:
    _, tree = _tree_with_leaves(num_leaves)
    tree.check_integrity()
    v0 = tree.num_visits
    freed = [tree.evict(1) for _ in range(calls)]
    assert all(len(f) == 1 for f in freed)
    tree.check_integrity()
    return (tree.num_visits - v0) / calls


def test_evict_cost_does_not_grow_with_the_number_of_cached_leaves():
    small, large = _visits_per_evict(200), _visits_per_evict(4000)
    assert small <= 2 and large <= 2, (small, large)


def test_evict_order_is_lru_across_touches():
    pool, tree = _tree_with_leaves(5)
    tree.match([1] * BS + [2, 0, 7, 9])  # touch leaf 2: it becomes the most recently used
    order = []
    for _ in range(5):
        freed = tree.evict(3)  # one whole leaf
        order.append(tree_leaf_of(freed))
    assert order == [0, 1, 3, 4, 2]
    assert tree.evict(1) != []  # the shared block, now a leaf itself
    tree.check_integrity()


def tree_leaf_of(freed: list[int]) -> int:
    return (min(freed) - 1) // 3  # blocks 1-3 are leaf 0's, 4-6 leaf 1's, ...


def _visits_growing_one_sequence(num_tokens: int) -> float:
    kv = KVCacheCoordinator(num_blocks=num_tokens // BS + 4, block_size=BS)
    kv.allocate_slots("s", 0, 8)
    tokens = list(range(8))
    kv.cache_blocks("s", tokens, 8)
    leaf = next(iter(kv.radix.root.children.values()))
    leaf_tokens = leaf.tokens
    v0 = kv.radix.num_visits
    for n in range(8, num_tokens):  # decode: one token a step, a block completes every BS steps
        assert kv.allocate_slots("s", n, 1) is not None
        tokens.append(n % 50)
        kv.cache_blocks("s", tokens, n + 1)
    assert kv.radix.num_cached_blocks == num_tokens // BS
    assert kv.radix.num_nodes == 1  # one leaf, extended in place: its token list is never copied
    assert leaf.tokens is leaf_tokens and len(leaf_tokens) == num_tokens // BS * BS
    kv.check_integrity()
    return (kv.radix.num_visits - v0) / (num_tokens // BS - 2)


def test_caching_a_growing_sequence_costs_the_same_per_block_at_any_length():
    short, long = _visits_growing_one_sequence(400), _visits_growing_one_sequence(8000)
    assert short <= 1 and long <= 1, (short, long)


def test_matched_prefix_then_growth_extends_from_the_request_node():
    """A request that matched part of a long cached leaf caches its next block under the split
    point without walking from the root again."""
    kv = KVCacheCoordinator(num_blocks=64, block_size=BS)
    first = list(range(40))
    kv.allocate_slots("a", 0, 40)
    kv.cache_blocks("a", first, 40)
    kv.free("a")
    prompt = first[:20] + [99] * 5
    m = kv.match_prefix(prompt)
    assert m.num_tokens == 20
    kv.allocate_slots("b", 20, 5, prefix=m)
    v0 = kv.radix.num_visits
    kv.cache_blocks("b", prompt, 25)
    assert kv.radix.num_visits - v0 <= 1
    assert kv.match_prefix(prompt + [0]).num_tokens == 24
    assert kv.match_prefix(first).num_tokens == 36  # a's branch is intact
    kv.check_integrity()


def _sched(num_blocks: int, budget: int = 64, max_seqs: int = 256, block_size: int = BS) -> Scheduler:
    # the token budget alone: these set-ups admit a queue at once (the "auto" cap, which spreads
    # it over a few steps, has its own test in test_kv.py)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                     max_admitted_prefill_tokens=None),
                     CacheConfig(block_size=block_size, num_kv_blocks=num_blocks), num_blocks)


def _admission_visits_per_step(num_waiting: int, prompt_tokens: int) -> float:
    """Decodes hold every block; ``num_waiting`` long prompts wait. Nodes visited by the scheduler
    per step (admission matching included)."""
    s = _sched(num_blocks=16, budget=256, block_size=16)
    for i in range(8):  # 8 decoding requests take all 16 blocks (2 each: room up to 32 tokens)
        s.add_request(Request(f"run{i}", [i + 1] * 17, SamplingParams(max_tokens=10_000), i, 0))
    out = s.schedule()
    s.update(out, [[7] for _ in out.scheduled])
    assert len(s.running) == 8 and s.kv.pool.num_free == 0
    for i in range(num_waiting):
        s.add_request(Request(f"w{i}", [100 + i] * prompt_tokens, SamplingParams(max_tokens=4), 100 + i, 0))
    v0 = s.kv.radix.num_visits
    steps = 12
    for _ in range(steps):
        out = s.schedule()
        assert len(out.scheduled) == 8 and not out.preempted  # nobody admitted: no block is free
        s.update(out, [[7] for _ in out.scheduled])
    s.check_integrity()
    return (s.kv.radix.num_visits - v0) / steps


def test_admission_does_not_rematch_the_queue_when_no_block_is_free():
    small, large = _admission_visits_per_step(16, 64), _admission_visits_per_step(256, 2048)
    assert small == large == 0, (small, large)


def test_admission_order_reuses_matches_while_the_tree_is_unchanged():
    """Waiting prompts whose first chunk does not fit: every step orders the window again, and
    matches it only when the tree changed since."""
    s = _sched(num_blocks=5, budget=32)
    for i in range(100):
        s.add_request(Request(f"w{i}", [2 + i] * 400, SamplingParams(max_tokens=4), i, 0))
    assert s.schedule().is_empty  # the first ordering matches the window: 100 prompts
    v0 = s.kv.radix.num_visits
    for _ in range(5):
        assert s.schedule().is_empty
    assert s.kv.radix.num_visits - v0 == 5  # the one candidate tried per step
    s.kv.radix.version += 1  # as after any insert or eviction: the window is matched again, once
    s.schedule()
    assert s.kv.radix.num_visits - v0 == 5 + 100 + 1


class _CountingList(list):
    """A waiting queue that counts how many of its elements a step iterates over."""

    def __init__(self, *a):
        super().__init__(*a)
        self.num_iterated = 0

    def __iter__(self):
        for x in super().__iter__():
            self.num_iterated += 1
            yield x


def test_offline_queue_bookkeeping_is_flat_per_step():
    """With 200 or 20,000 requests waiting (one offline ``generate`` call), a step looks at the
    same number of them: the ordering window, never the whole queue."""
    def elements_touched_per_step(num_waiting: int) -> tuple[int, int]:
        s = _sched(num_blocks=4000, budget=64, max_seqs=8)
        for i in range(num_waiting):
            s.add_request(Request(f"w{i}", [3 + i % 50, 5, 6], SamplingParams(max_tokens=1), i, 0))
        s.waiting = _CountingList(s.waiting)
        matches = {"n": 0}
        orig = s.kv.match_prefix

        def counting(tokens, *args, **kw):
            matches["n"] += 1
            return orig(tokens, *args, **kw)

        s.kv.match_prefix = counting
        for _ in range(3):
            out = s.schedule()
            assert len(out.scheduled) == 8
            for req in s.update(out, [[9] for _ in out.scheduled]):
                s.finish_request(req, RequestStatus.FINISHED_LENGTH)
        assert isinstance(s.waiting, _CountingList) and len(s.waiting) == num_waiting - 24
        return s.waiting.num_iterated, matches["n"]

    assert elements_touched_per_step(200) == elements_touched_per_step(20_000)


def test_offline_generate_feeds_the_queue_as_it_drains(tiny_llama):
    """One generate call with far more prompts than max_waiting_requests: all are served, and the
    waiting queue a step scans never exceeds the limit."""
    from prefixkv import LLM, SamplingParams

    llm = LLM(model=str(tiny_llama), block_size=4, num_kv_blocks=1024, max_waiting_requests=32, max_num_seqs=16)
    eng = llm.engine
    real, peak = eng.step, {"waiting": 0}

    def step():
        peak["waiting"] = max(peak["waiting"], eng.scheduler.num_waiting)
        return real()

    eng.step = step
    prompts = [[5 + i % 97, 6 + i % 13, 7] for i in range(400)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [2] * 400
    assert peak["waiting"] == 32
    assert not eng.has_unfinished() and eng.scheduler.kv.num_used_blocks == 0


# ------------------------------------------------------------------ the runner's block tables
def _prep_runner(block_size: int, max_blocks: int = 8, num_groups: int = 1):
    """ModelRunner.prepare's host side, without a model (its persistent block tables; one per KV
    cache group)."""
    from types import SimpleNamespace

    import torch

    from prefixkv.runner.block_table import BlockTables

    return SimpleNamespace(block_size=block_size, device=torch.device("cpu"), max_model_len=1 << 20,
                           block_tables=[BlockTables(max_blocks, num_rows=2) for _ in range(num_groups)])


def _check_step_inputs(s: Scheduler, runner, out) -> None:
    """The runner's step inputs, built from its persistent tables and the step's deltas, equal
    those built from the scheduler's whole tables: every row, its padding, every slot."""
    from prefixkv.runner.model_runner import ModelRunner

    input_ids, positions, metas, _ = ModelRunner.prepare(runner, out)
    kv, bs = s.kv, s.block_size
    assert len(metas) == len(kv.windows)
    exp_ids, exp_pos = [], []
    for x in out.scheduled:
        ps = range(x.num_computed_tokens, x.num_computed_tokens + x.num_scheduled_tokens)
        exp_pos += ps
        known = x.req.token_ids.tolist()
        exp_ids += [known[x.num_computed_tokens], *x.draft] if x.draft else known[ps.start:ps.stop]
    assert positions.tolist() == exp_pos and input_ids.tolist() == exp_ids
    for g, meta in enumerate(metas):
        tables = [kv.block_tables[x.req.seq_id][g] for x in out.scheduled]
        width = max(len(t) for t in tables)
        got = meta.block_tables.tolist()
        # entries a windowed group gave back (NULL here) stay stale in the runner's copy: no kernel reads them
        assert [[r if b == kv.NULL else b for b, r in zip(t, row)] + [0] * (width - len(t))
                for t, row in zip(tables, got)] == got, g
        exp_slots = [t[p // bs] * bs + p % bs for x, t in zip(out.scheduled, tables)
                     for p in range(x.num_computed_tokens, x.num_computed_tokens + x.num_scheduled_tokens)]
        assert meta.slot_mapping.tolist() == exp_slots
        assert all(t[p // bs] != kv.NULL for x, t in zip(out.scheduled, tables)
                   for p in range(x.num_computed_tokens, x.num_computed_tokens + x.num_scheduled_tokens))
    assert all(set(t.rows) <= set(s.kv.block_tables) for t in runner.block_tables)  # released tables were forgotten


@pytest.mark.parametrize("windows", [(None,), (None, 6, 6)])
def test_runner_block_tables_follow_forks_preemption_drafts_and_frees(windows):
    """A random workload on a small pool (preemptions, evictions), n > 1 forks (copy-on-write of
    the shared partial block), speculative drafts with rejections (trimmed tables), finishes and
    re-used row slots: at every step the runner's tables equal the scheduler's. With KV cache
    groups (a full group and two windowed ones): each group's table and slots, whatever the
    windowed groups gave back."""
    import random

    rng = random.Random(5)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=6, num_speculative_tokens=3,
                                  prompt_lookup_min=1, prompt_lookup_max=2),
                  CacheConfig(block_size=BS, num_kv_blocks=16 * len(windows)), 16 * len(windows),
                  kv_windows=windows)
    runner = _prep_runner(BS, max_blocks=2, num_groups=len(windows))  # rows and columns both grow
    pattern = [11, 12, 13]  # greedy requests repeat it: their n-gram drafts are proposed, some accepted
    arrivals = 0
    seen = {"preempt": 0, "fork": 0, "draft": 0, "trim": 0}
    for step in range(300):
        if arrivals < 40 and rng.random() < 0.5:
            n = rng.choice([1, 1, 2, 3])
            prompt = pattern * rng.randrange(1, 4) + [rng.randrange(20, 90) for _ in range(rng.randrange(1, 9))]
            params = SamplingParams(max_tokens=rng.randrange(2, 14), n=n, temperature=0.0 if n == 1 else 1.0)
            s.add_request(Request(f"q{arrivals}", prompt, params, arrivals, arrivals))
            arrivals += 1
        out = s.schedule()
        if out.is_empty:
            if not s.has_unfinished() and arrivals >= 40:
                break
            continue
        seen["preempt"] += len(out.preempted)
        seen["draft"] += sum(1 for x in out.scheduled if x.draft)
        _check_step_inputs(s, runner, out)
        sampled = []
        for x in out.scheduled:
            if x.draft:  # accept a random prefix of the draft, then the model's own next token
                keep = rng.randrange(len(x.draft) + 1)
                seen["trim"] += keep < len(x.draft)
                sampled.append(x.draft[:keep] + [pattern[(len(x.req.token_ids) + keep) % 3]])
            else:
                sampled.append([pattern[len(x.req.token_ids) % 3] for _ in range(x.num_samples)])
        seen["fork"] += sum(1 for x in out.scheduled if x.num_samples > 1)
        for req in s.update(out, sampled):
            if req.num_output_tokens >= req.sampling_params.max_tokens:
                s.finish_request(req, RequestStatus.FINISHED_LENGTH)
        s.check_integrity()
    assert not s.has_unfinished() and not s.kv.block_tables
    assert all(v > 0 for v in seen.values()), seen
    # the last finishes reach the runner with the next step that runs: a request scheduled after them
    s.add_request(Request("last", [1, 2, 3], SamplingParams(max_tokens=1), 99, 0))
    out = s.schedule()
    _check_step_inputs(s, runner, out)
    assert all(list(t.rows) == ["last#0"] for t in runner.block_tables)


def _decode_step_costs(context_tokens: int, num_running: int = 8, steps: int = 2 * BS) -> tuple[float, float]:
    """Decoding requests at ``context_tokens``: block-table entries the runner writes and token
    ids the step copies, per step (the first step, which hands over the whole tables, excluded)."""
    from prefixkv.runner.model_runner import ModelRunner

    blocks = num_running * (context_tokens // BS + 4) * 11 // 10  # room above the admission watermark
    s = _sched(num_blocks=blocks, budget=context_tokens * num_running, max_seqs=num_running)
    for i in range(num_running):
        s.add_request(Request(f"r{i}", [i + 1] * context_tokens, SamplingParams(max_tokens=1 << 20), i, 0))
    runner = _prep_runner(BS, max_blocks=context_tokens // BS + 4)
    out = s.schedule()
    ModelRunner.prepare(runner, out)
    s.update(out, [[7] for _ in out.scheduled])
    w0, copied = runner.block_tables[0].num_entries_written, 0
    for _ in range(steps):
        out = s.schedule()
        assert out.num_decodes == num_running
        copied += sum(len(x.token_ids) for x in out.scheduled)
        ModelRunner.prepare(runner, out)
        s.update(out, [[7] for _ in out.scheduled])
    return (runner.block_tables[0].num_entries_written - w0) / steps, copied / steps


def test_decode_step_inputs_do_not_grow_with_the_context():
    """A decode step hands the runner its new blocks and its one token, at 64 or 4,096 tokens of
    context (the whole tables were rebuilt every step before: 24 ms at 256 x 32k)."""
    small, large = _decode_step_costs(64), _decode_step_costs(4096)
    assert small == large == (8 / BS, 8), (small, large)


def _gc_walked_elements(context_tokens: int, num_running: int = 4, num_blocks: int = 10_000) -> int:
    """Elements of GC-tracked containers that the scheduler, the KV index and the runner's tables
    add for ``num_running`` decoding requests (what each full collection walks)."""
    import gc
    import warnings

    from prefixkv.runner.model_runner import ModelRunner

    def walked() -> int:
        gc.collect()
        with warnings.catch_warnings():  # (isinstance on deprecated module attributes warns)
            warnings.simplefilter("ignore")
            return sum(len(o) for o in gc.get_objects() if isinstance(o, (list, tuple, dict, set)))

    base = walked()
    s = _sched(num_blocks=num_blocks, budget=context_tokens * num_running, max_seqs=num_running)
    for i in range(num_running):
        s.add_request(Request(f"r{i}", [i + 1] * context_tokens, SamplingParams(max_tokens=1 << 20), i, 0))
    runner = _prep_runner(BS, max_blocks=context_tokens // BS + 4)
    for _ in range(3):
        out = s.schedule()
        ModelRunner.prepare(runner, out)
        s.update(out, [[7] for _ in out.scheduled])
    n = walked() - base
    del s, runner, out
    return n


def test_garbage_collector_does_not_walk_the_tokens():
    """Token ids live in int64 arrays (requests, radix nodes), which a full collection does not walk:
    with lists, each full collection visited every token of every live request (a 0.2 s pause every
    ~70 steps at 256 requests x 32k tokens). What remains grows with the blocks (block tables, the
    tree's block ids and block -> node map: 3 per block), 1/BS of the tokens each."""
    small, large = _gc_walked_elements(512), _gc_walked_elements(8192)
    more_tokens = 4 * (8192 - 512)
    # measured: + 3 per block; with the tokens in lists (request, radix node): + 11 per block
    assert large - small <= 4 * more_tokens // BS, (small, large)
