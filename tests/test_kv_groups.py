"""KV cache groups (kv/groups.py): sliding-window layers' blocks outside the window go back to the
pool. Exact page ids and counts per group while a request advances, prefix hits that need only the
window's pages, eviction of released windowed pages before the window's end, and the engine on a
Gemma-3-shaped model: token-identical to transformers and holding several times more requests."""

from __future__ import annotations

import pytest

from prefixkv import LLM, SamplingParams
from prefixkv.kv import KVCacheCoordinator
from prefixkv.kv.groups import plan_kv_groups, window_start


def test_plan_groups_layers_by_attention_type():
    # Gemma 3 1B: 26 layers, every sixth full attention, the rest a window of 512
    windows = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(26))
    plan = plan_kv_groups(windows)
    assert plan.layers_per_page == 4 and plan.windows == (None,) + (512,) * 6
    assert [i for i in range(26) if plan.layer_group[i] == 0] == [5, 11, 17, 23]
    assert [i for i in range(26) if plan.layer_group[i] == 2] == [4, 6, 7, 8]
    assert [i for i in range(26) if plan.layer_group[i] == 6] == [24, 25]  # two slots unused
    assert [plan.layer_slot[i] for i in (5, 11, 17, 23)] == [0, 1, 2, 3]
    assert plan.hybrid
    # Gemma 2: alternating, two groups of half the layers
    g2 = plan_kv_groups((4096, None) * 3)
    assert g2.windows == (None, 4096) and g2.layers_per_page == 3 and g2.layer_group == (1, 0) * 3
    # Mistral v0.1: every layer windowed, one group whose pages are freed too
    assert plan_kv_groups((8,) * 4) == plan_kv_groups((8,) * 4)
    m = plan_kv_groups((8,) * 4)
    assert m.windows == (8,) and m.layers_per_page == 4 and m.hybrid
    # no window, or disabled: the classic layout, one page = one block of every layer
    for plan in (plan_kv_groups((None,) * 4), plan_kv_groups(windows, hybrid=False)):
        assert plan.windows == (None,) and plan.layers_per_page == plan.num_layers and not plan.hybrid
        assert plan.layer_slot == tuple(range(plan.num_layers))
    # the most pages a 100-token sequence holds in 16-token chunks: all 25 full blocks, a window +
    # a chunk (8 + 16 tokens: 6 + 1 blocks) per windowed group
    assert plan_kv_groups((None, 8, 8)).pages_for(100, 4, 16) == 25 + 2 * 7


def test_windowed_pages_go_back_as_a_request_decodes():
    kv = KVCacheCoordinator(40, 4, enable_prefix_caching=False, windows=(None, 8))
    N = kv.NULL
    assert kv.allocate_slots("a", 0, 10) == []
    assert kv.block_tables["a"] == ([0, 2, 4], [1, 3, 5])
    assert kv.pool.num_free == 34
    assert kv.allocate_slots("a", 10, 1) == []  # the query at 10 sees 3 .. 10: block 0 still needed
    assert kv.block_tables["a"][1:] == ([1, 3, 5],)
    assert kv.allocate_slots("a", 11, 1) == []  # 4 .. 11: block 0 of the windowed group goes back
    assert kv.block_tables["a"][1:] == ([N, 3, 5],) and kv.pool.num_free == 35 and kv.pool.free_ids[-1] == 1
    assert kv.allocate_slots("a", 12, 1) == []  # a new block: a page in each group
    assert kv.block_tables["a"] == ([0, 2, 4, 6], [N, 3, 5, 7])
    for n in range(13, 60):
        assert kv.allocate_slots("a", n, 1) == []
        blocks = -(-(n + 1) // 4)
        start = max(0, n - 7) // 4
        extra = kv.block_tables["a"][1]
        assert len(kv.block_tables["a"][0]) == len(extra) == blocks
        assert extra[:start] == [N] * start and N not in extra[start:]
        assert kv.pool.num_free == 40 - blocks - (blocks - start), n  # the window holds 2-3 pages
        kv.check_integrity()
    assert kv.pool.num_free == 40 - 15 - 2  # at 59: blocks 13 and 14 (tokens 52 .. 59) of the window
    kv.free("a")
    assert kv.pool.num_free == 40
    kv.check_integrity()


def test_prefix_hit_needs_only_the_windows_pages_and_released_ones_go_first():
    kv = KVCacheCoordinator(64, 4, enable_prefix_caching=True, windows=(None, 8))
    N = kv.NULL
    toks = list(range(100, 121))  # 21 tokens: 5 full blocks
    assert kv.allocate_slots("a", 0, 21) == []
    kv.cache_blocks("a", toks, 21)
    anchor, extra = [list(t) for t in kv.block_tables["a"]]
    assert anchor == [0, 2, 4, 6, 8, 10] and extra == [1, 3, 5, 7, 9, 11]
    kv.free("a")  # the caches keep the 5 full blocks' pages of both groups
    assert kv.num_cached_blocks == 10 and kv.pool.num_evictable == 10
    kv.check_integrity()
    m = kv.match_prefix(toks + [7, 8])
    # a query at 20 sees 13 .. 20: of the windowed group only blocks 3 and 4 are handed out
    assert m.num_tokens == 20 and m.blocks == ([0, 2, 4, 6, 8], [N, N, N, 7, 9])
    # released windowed pages go first, earliest first; the full group's stay
    assert kv.evict(3) == [1, 3, 5]
    m = kv.match_prefix(toks + [7, 8])
    assert m.num_tokens == 20 and m.blocks[1:] == ([N, N, N, 7, 9],)
    assert kv.allocate_slots("b", 20, 3, prefix=m) == []
    assert kv.block_tables["b"] == ([0, 2, 4, 6, 8, 12], [N, N, N, 7, 9, 13])
    assert [kv.pool.ref_cnt[b] for b in (0, 8, 7, 9)] == [2, 2, 2, 2]
    kv.check_integrity()
    kv.free("b")
    # the page at block 3 lost: a query at 20 (or 16, 12, ...) lacks part of its window: no hit
    assert kv.evict(1) == [7]
    m = kv.match_prefix(toks + [7, 8])
    assert m.num_tokens == 0 and m.blocks == ([], [])
    assert kv.match_prefix(toks[:9]).num_tokens == 0  # a query at 8 sees 1 .. 8: blocks 0 and 1, gone
    assert kv.evict(64)  # everything else
    kv.check_integrity()
    assert kv.pool.num_free == 64


def test_an_every_layer_windowed_model_caches_pages_out_of_its_window():
    """Mistral v0.1: every layer windowed, one group; its cache keeps the pages a request let go of,
    evictable in that order."""
    kv = KVCacheCoordinator(32, 4, enable_prefix_caching=True, windows=(8,))
    N = kv.NULL
    toks = list(range(1, 30))
    assert kv.allocate_slots("a", 0, 16) == []
    kv.cache_blocks("a", toks, 16)
    assert kv.allocate_slots("a", 16, 8) == []  # from 16: blocks 0 and 1 (tokens 0 .. 7) go back
    kv.cache_blocks("a", toks, 24)
    assert kv.block_tables["a"][0][:3] == [N, N, 2]
    assert kv.pool.num_evictable == 2  # the cache's copies of blocks 0 and 1
    kv.check_integrity()
    assert kv.evict(2) == [0, 1]
    assert kv.match_prefix(toks[:25]).num_tokens == 24  # a query at 24 sees 17 .. 24: blocks 4, 5
    assert kv.match_prefix(toks[:9]).num_tokens == 0  # a query at 8 would need block 0
    kv.free("a")
    kv.check_integrity()


@pytest.fixture(scope="module")
def long_prompts():
    import random

    rng = random.Random(5)
    return [[rng.randrange(3, 384) for _ in range(110 + 3 * i)] for i in range(8)]


def test_engine_frees_out_of_window_blocks_and_fits_more_requests(tiny_gemma3, long_prompts):
    """Gemma 3 shape (window 4 on 2 of 3 layers), prompts of 110-131 tokens, the same KV memory with
    and without groups: token-identical to transformers both ways, and the groups run 2x as many
    requests at once."""
    from test_lossless import hf_reference

    refs = hf_reference(tiny_gemma3, long_prompts, max_tokens=12)
    peaks = {}
    for disable in (False, True):
        llm = LLM(model=str(tiny_gemma3), dtype="float64", block_size=4, num_kv_blocks=110,
                  max_num_batched_tokens=512, disable_hybrid_kv_cache_manager=disable)
        eng = llm.engine
        eng.check_integrity_each_step = True
        assert eng.runner.kv_plan.num_groups == (1 if disable else 3)
        assert eng.info.num_kv_blocks == (110 if disable else 330)  # pages: one layer each with groups
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(long_prompts):
            eng.add_request(str(i), p, params)
        peak, outs = 0, {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o.outputs[0].token_ids
            peak = max(peak, eng.scheduler.num_running)
            kv = eng.scheduler.kv
            for r in eng.scheduler.running:
                if r.num_computed_tokens <= r.num_prompt_tokens:
                    continue  # (its prefill step's pages go at its next schedule)
                # decoding: scheduled from num_computed - 1, so each windowed group holds only the
                # blocks from that query's window on (2 of 4-token blocks for a window of 4)
                for g, w in enumerate(kv.windows):
                    t = kv.block_tables[r.seq_id][g]
                    assert len(t) == -(-r.num_computed_tokens // 4)
                    held = sum(b != kv.NULL for b in t)
                    start = 0 if w is None else window_start(w, r.num_computed_tokens - 1, 4)
                    assert held == len(t) - start and held <= (len(t) if w is None else 2)
        assert [outs[str(i)] for i in range(len(long_prompts))] == refs
        assert eng.scheduler.kv.num_used_blocks == 0
        peaks[disable] = peak
    assert peaks[True] <= 3 and peaks[False] >= 2 * peaks[True], peaks


def test_mistral_window_serves_prompts_longer_than_its_pool(tiny_mistral_window):
    """Every layer windowed (8 tokens): a 200-token prompt computed in 16-token chunks holds at most
    a window plus a chunk of blocks, so a pool of 20 blocks (80 tokens) serves it, token-identical
    to transformers; keeping every block it is refused. The context is the model's, not the window."""
    import json
    import random

    from test_lossless import hf_reference

    rng = random.Random(3)
    prompts = [[rng.randrange(3, 384) for _ in range(200)], [rng.randrange(3, 384) for _ in range(150)]]
    refs = hf_reference(tiny_mistral_window, prompts, max_tokens=12)
    cfg = json.loads((tiny_mistral_window / "config.json").read_text())
    llm = LLM(model=str(tiny_mistral_window), dtype="float64", block_size=4, num_kv_blocks=20,
              max_num_batched_tokens=16)
    llm.engine.check_integrity_each_step = True
    assert llm.engine.info.max_model_len == cfg["max_position_embeddings"] > 8
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == refs
    kept = LLM(model=str(tiny_mistral_window), dtype="float64", block_size=4, num_kv_blocks=20,
               max_num_batched_tokens=16, disable_hybrid_kv_cache_manager=True)
    with pytest.raises(ValueError, match=r"prompt: 200 tokens need 51 KV blocks but the cache has only 20"):
        kept.generate(prompts[:1], SamplingParams(max_tokens=12))


def test_a_windowed_groups_pages_go_down_a_tier_and_come_back():
    """With the host tier (kv/tiers.py): an evicted page of every group gets a host slot, the
    windowed ones as the full ones; a returning prompt gets every full block from the tier and,
    of the windowed group, only the blocks its window sees at the hit's end; fresh pages, loaded
    before its step."""
    from prefixkv.kv import TierConnector

    tiers = TierConnector(num_host_pages=16)
    kv = KVCacheCoordinator(16, 4, enable_prefix_caching=True, windows=(None, 8), lower=tiers)
    N = kv.NULL
    toks = list(range(100, 121))  # 21 tokens: 5 full blocks
    assert kv.allocate_slots("a", 0, 21) == []
    kv.cache_blocks("a", toks, 21)
    assert kv.block_tables["a"] == ([0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 11])
    kv.free("a")
    # everything goes: the windowed pages first (let go of in that order), then the full ones tail first
    assert kv.evict(16) == [1, 3, 5, 7, 9, 8, 6, 4, 2, 0]
    plan = tiers.take_plan([])
    assert plan.saves == [(1, 0), (3, 1), (5, 2), (7, 3), (9, 4), (8, 5), (6, 6), (4, 7), (2, 8), (0, 9)]
    tiers.begin_step(False)
    kv.check_integrity()
    m = kv.match_prefix(toks + [7, 8])
    assert m.num_tokens == 0
    m = kv.match_prefix(toks + [7, 8], lower=True)
    # a query at 20 sees 13 .. 20: the windowed group needs blocks 3 and 4 only
    assert m.num_tokens == 20 and m.blocks == ([N] * 5, [N] * 5)
    assert [(r.group, r.index) for r in m.lower] == [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (1, 3), (1, 4)]
    assert kv.allocate_slots("b", 20, 3, prefix=m) == []
    assert kv.block_tables["b"] == ([12, 13, 14, 15, 10, 3], [N, N, N, 11, 1, 5])
    plan = tiers.take_plan([])
    assert plan.loads == [(9, 12), (8, 13), (7, 14), (6, 15), (5, 10), (3, 11), (4, 1)] and not plan.saves
    assert tiers.host.num_used == 3  # the windowed blocks 0-2 the hit did not need stay there
    kv.check_integrity()
    kv.cache_blocks("b", toks + [7, 8], 20)  # the loaded pages are the device caches' again
    assert kv.match_prefix(toks + [7, 8]).blocks == ([12, 13, 14, 15, 10], [N, N, N, 11, 1])
    kv.free("b")
    kv.check_integrity()
