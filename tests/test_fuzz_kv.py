"""Stateful fuzzing of BlockPool + the per-attention-type managers + KVCacheCoordinator against a
model of the truth: which tokens each physical page holds. Every match is checked against it, no
write ever lands in a shared page, and check_integrity() holds after every rule.
``TieredKVMachine`` adds the host tier (the connector, kv/tiers.py): the truth of each host slot
too, each step's plan applied in the worker's order (spills, saves, then loads, before the step's
writes), every lower-tier hit checked to bring back exactly its tokens."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from prefixkv.kv import KVCacheCoordinator, TierConnector
from prefixkv.kv.groups import window_start

BLOCK_SIZE = 2
NUM_BLOCKS = 12
TOKENS = st.integers(min_value=1, max_value=3)  # a tiny alphabet: lots of shared prefixes
SETTINGS = settings(max_examples=int(os.environ.get("PREFIXKV_FUZZ_EXAMPLES", "500")), stateful_step_count=40,
                    deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _test_case(machine: type[RuleBasedStateMachine]):
    machine.TestCase.settings = SETTINGS
    return machine.TestCase


class KVMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0  # the retention's clock (kv/retention.py)
        self.kv = KVCacheCoordinator(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True, clock=lambda: self.now)
        self.truth: dict[int, list[int | None]] = {}  # page id -> tokens its KV holds
        self.seqs: dict[str, list[int]] = {}  # seq id -> tokens computed (KV written)
        self.next_id = 0
        self.num_host_hits = 0

    # -- shared steps of the rules -------------------------------------------------------------
    def _apply(self, seq: str, tokens: list[int], start: int, ops) -> None:
        for op in ops:  # the runner copies before the forward pass
            self.truth[op.dst] = list(self.truth[op.src])
        for t in self.kv.block_tables[seq]:
            for p in range(start, len(tokens)):
                b = t[p // BLOCK_SIZE]
                assert b != self.kv.NULL, f"{seq} writes position {p} into a freed page"
                assert self.kv.pool.ref_cnt[b] == 1, f"write into shared block {b} (ref {self.kv.pool.ref_cnt[b]})"
                self.truth.setdefault(b, [None] * BLOCK_SIZE)[p % BLOCK_SIZE] = tokens[p]
        self.kv.cache_blocks(seq, tokens, len(tokens))
        self.seqs[seq] = list(tokens)

    def _check_match(self, tokens: list[int]) -> None:
        m = self.kv.match_prefix(tokens)
        n = len(m.blocks[0])
        assert m.num_tokens == n * BLOCK_SIZE and m.num_tokens <= max(0, len(tokens) - 1) and not m.lower
        for g, pages in enumerate(m.blocks):
            assert len(pages) == n
            w = self.kv.windows[g]
            start = 0 if w is None else window_start(w, m.num_tokens, BLOCK_SIZE)
            for i, b in enumerate(pages):
                if i < start:
                    assert b == self.kv.NULL, f"group {g} hands out page {b} before its window"
                    continue
                assert b != self.kv.NULL, f"group {g} lacks block {i} of its window"
                assert self.truth[b] == tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE], (g, b, self.truth[b], tokens)

    def _swap(self) -> None:
        """The worker's copies between tiers at the start of a step (none without lower tiers)."""

    def _add(self, tokens: list[int]) -> None:
        self._check_match(tokens)
        m = self.kv.match_prefix(tokens, lower=True)  # the lower tiers' pages too (none without them)
        cached = m.num_tokens
        seq = f"s{self.next_id}"
        self.next_id += 1
        ops = self.kv.allocate_slots(seq, cached, len(tokens) - cached, prefix=m)
        if ops is None:
            assert seq not in self.kv.block_tables
            return
        assert ops == []
        self._swap()
        tables = self.kv.block_tables[seq]
        for r in m.lower:  # what came back from a lower tier
            assert self.truth[tables[r.group][r.index]] == tokens[r.index * BLOCK_SIZE:(r.index + 1) * BLOCK_SIZE], \
                (r, tokens)
            self.num_host_hits += 1
        self._apply(seq, tokens, cached, ops)

    # -- rules --------------------------------------------------------------------------------
    @rule(tokens=st.lists(TOKENS, min_size=1, max_size=9))
    def add(self, tokens):
        self._add(tokens)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), tok=TOKENS, n=st.integers(1, 3))
    def append(self, data, tok, n):
        seq = data.draw(st.sampled_from(sorted(self.seqs)))
        tokens = self.seqs[seq]
        ops = self.kv.allocate_slots(seq, len(tokens), n)
        if ops is None:
            return
        self._swap()
        self._apply(seq, tokens + [tok] * n, len(tokens), ops)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.seqs)))
        child = f"s{self.next_id}"
        self.next_id += 1
        self.kv.fork(parent, child)
        self.seqs[child] = list(self.seqs[parent])

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.seqs)))
        self.kv.free(seq)
        del self.seqs[seq]

    def _unretained_evictable(self) -> int:
        kv = self.kv
        kv.retention.expire()
        return sum(1 for p, key, _ in kv.cached_pages() if kv.pool.ref_cnt[p] == 1 and key[0] not in kv.retention)

    @rule(n=st.integers(1, NUM_BLOCKS))
    def evict(self, n):
        before = self.kv.pool.num_evictable
        retained_evicted = self.kv.retention.num_evicted
        freed = self.kv.evict(n)
        # every evictable page is reachable (a cached unit goes with all its pages: n + groups - 1 at most)
        assert min(n, before) <= len(freed) <= min(before, n + len(self.kv.windows) - 1), (n, before, freed)
        if self.kv.retention.num_evicted > retained_evicted:  # retained pages go only after all others
            assert self._unretained_evictable() == 0
        for b in freed:
            self.truth.pop(b, None)

    @rule(tokens=st.lists(TOKENS, min_size=1, max_size=12), ttl=st.sampled_from([1.0, 5.0]))
    def retain(self, tokens, ttl):
        self.kv.retain(tokens, len(tokens), ttl)

    @rule(dt=st.sampled_from([0.5, 2.0, 10.0]))
    def advance_clock(self, dt):
        self.now += dt

    @rule(tokens=st.lists(TOKENS, min_size=1, max_size=12))
    def match(self, tokens):
        self._check_match(tokens)

    # -- invariants ------------------------------------------------------------------------------
    @invariant()
    def integrity(self):
        self.kv.check_integrity()
        for b, toks in self.kv.cached_blocks().items():
            assert self.truth[b] == list(toks), (b, self.truth[b], toks)
        for seq, tokens in self.seqs.items():
            for g, t in enumerate(self.kv.block_tables[seq]):
                w = self.kv.windows[g]
                start = 0 if w is None else window_start(w, len(tokens), BLOCK_SIZE)
                for p, tok in enumerate(tokens):
                    b = t[p // BLOCK_SIZE]
                    if b == self.kv.NULL:
                        assert p // BLOCK_SIZE < start, (seq, g, p, "a page inside the window is missing")
                        continue
                    assert self.truth[b][p % BLOCK_SIZE] == tok, (seq, g, p)


TestKVMachine = _test_case(KVMachine)


HOST_SLOTS = 5
DISK_BLOCKS = 6


class TieredKVMachine(KVMachine):
    WINDOWS: tuple = (None,)
    HOST: int = HOST_SLOTS
    DISK: int = 0

    def __init__(self) -> None:
        super().__init__()
        self.tiers = TierConnector(self.HOST, self.DISK)
        self.kv = KVCacheCoordinator(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True, windows=self.WINDOWS,
                                     lower=self.tiers, clock=lambda: self.now)
        self.host_truth: dict[int, list[int | None]] = {}  # host slot -> tokens its KV holds
        self.files: dict[int, list[int | None]] = {}  # disk-tier key -> tokens its file holds
        self.gone: list[list[int]] = []  # tokens of freed sequences: prompts that come back

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.seqs)))
        self.gone.append(self.seqs[seq] + [1])
        self.kv.free(seq)
        del self.seqs[seq]

    @precondition(lambda self: self.gone)
    @rule(data=st.data())
    def come_back(self, data):
        """A conversation returns after others may have pushed its blocks down to the host tier."""
        self._add(data.draw(st.sampled_from(self.gone)))

    def _swap(self) -> None:
        """What the worker does with the step's plan; then the next step begins."""
        plan = self.tiers.take_plan([])
        for slot, key, tokens in plan.spills:  # files first: the slots may be reused below
            assert self.host_truth[slot] == list(tokens), (slot, tokens)
            self.files[key] = list(self.host_truth[slot])
        out, inn = plan.saves, plan.loads
        # the worker copies each list with one batched index_copy_: a slot (or page) twice in a
        # list would leave which copy wins undefined
        assert len({s for _, s in out}) == len(out) and len({b for _, b in inn}) == len(inn), (out, inn)
        for b, slot in out:
            self.host_truth[slot] = list(self.truth[b])
        for slot, b in inn:
            self.truth[b] = list(self.host_truth[slot])
        for key, b in plan.file_loads:
            self.truth[b] = list(self.files[key])
        for key in plan.drops:
            del self.files[key]
        self.tiers.begin_step(False)

    @rule(n=st.integers(1, NUM_BLOCKS))
    def evict(self, n):
        before = self.kv.pool.num_evictable
        free_before = self.kv.pool.num_free
        self.kv.evict(n)
        freed = self.kv.pool.num_free - free_before
        assert min(n, before) <= freed <= min(before, n + len(self.kv.windows) - 1), (n, before, freed)
        self._swap()

    @invariant()
    def host_integrity(self):
        host, disk = self.tiers.host, self.tiers.disk
        assert host.num_used <= host.num_slots
        for key, (slot, tokens) in host._entries.items():
            assert self.host_truth[slot] == list(tokens), (slot, self.host_truth[slot], tokens)
        if disk is not None:
            assert disk.num_used <= self.DISK and set(disk._entries) == set(self.files)
            for key, tokens in disk._entries.items():
                assert self.files[key] == list(tokens), (key, self.files[key], tokens)


TestTieredKVMachine = _test_case(TieredKVMachine)


class DiskTieredKVMachine(TieredKVMachine):
    """The same with a disk tier under a 2-slot host tier: blocks the host lets go of go to files
    (written before their slot is reused), and come back from them."""

    HOST = 2
    DISK = DISK_BLOCKS


TestDiskTieredKVMachine = _test_case(DiskTieredKVMachine)



class GroupedKVMachine(KVMachine):
    """KV cache groups (kv/groups.py): a full group and a windowed one (window 3 tokens). Each
    group's pages have their own truth; pages before a group's window are given back as requests
    advance; every match is checked in every group, and each windowed group must hold every page
    its window needs at the match's end; every evictable page stays reachable."""

    WINDOWS: tuple = (None, 3)

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheCoordinator(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True, windows=self.WINDOWS,
                                     clock=lambda: self.now)


TestGroupedKVMachine = _test_case(GroupedKVMachine)


class WindowedAnchorKVMachine(GroupedKVMachine):
    """Every layer windowed (Mistral v0.1): one group, no radix index; its cache keeps pages by hash."""

    WINDOWS = (4,)


TestWindowedAnchorKVMachine = _test_case(WindowedAnchorKVMachine)


class TwoWindowsKVMachine(GroupedKVMachine):
    """No full group, two windows (3 and 6 tokens): the anchor windowed beside a wider windowed group."""

    WINDOWS = (3, 6)


TestTwoWindowsKVMachine = _test_case(TwoWindowsKVMachine)


class WindowedTieredKVMachine(TieredKVMachine):
    """The host tier under a full-attention group and a windowed one (window 3 tokens): every
    group's pages go down when evicted and come back for a hit, which needs each group's pages of
    its window at the hit's end, from the device or the tier."""

    WINDOWS = (None, 3)


TestWindowedTieredKVMachine = _test_case(WindowedTieredKVMachine)


class WindowedDiskTieredKVMachine(TieredKVMachine):
    """Two windows (3 and 6 tokens, no full group: no radix index) over a 2-slot host tier and the
    disk tier."""

    WINDOWS = (3, 6)
    HOST = 2
    DISK = DISK_BLOCKS


TestWindowedDiskTieredKVMachine = _test_case(WindowedDiskTieredKVMachine)
