"""The KV cache as the scheduler sees it: every request's block table per KV cache group, over one
block pool, with a manager per attention type (kv/managers.py) and the lower tiers under it
(kv/tiers.py). No torch.

A request's tables (one per group, all as long as each other: a block takes a page of every
group) cover its computed tokens plus the tokens scheduled this step::

    token positions  0 ........................................ num_tokens
    blocks           [ full | full | full (cached) | partial ]
    full-attention   [ p0   | p1   | p2            | p3      ]
    sliding window   [ NULL | NULL | p6            | p7      ]   (pages before the window given back)

A model without sliding windows has one group; nothing here asks how many there are.

Copy-on-write: a page with ref_cnt > 1 is never written. Only a partial block can be written into
(full blocks are complete), and only forks (n > 1) share a partial block; before a request writes
into a shared partial block it gets a fresh copy of each group's page and a ``CopyOp(src, dst)``
is emitted for the runner to apply before the forward pass.

The runner keeps its own copy of every live table (a persistent array per group, as vLLM's
``BlockTable``); ``take_table_deltas`` tells it what changed since a request was last scheduled
(``TableDelta``: first changed index, each group's ids from there), and ``take_released`` which
tables were dropped, so a step hands over the new blocks only, never whole tables. Every count
here (``num_blocks``, free, evictable, needed) is in pages.

Eviction takes the oldest cached unit (a block's pages of one attention type) by the pool's LRU
clock, a windowed one first on a tie; a lower tier, if any, gets a copy of every page evicted to
make room (``TierConnector.save``). Retained prefixes (``retain``, kv/retention.py) are spared
while anything else can go; when only they are left, they go too (counted), so retention never
changes whether an allocation succeeds.

KV events (``events``, a ``KVEventLog``; None: off, and nothing here costs anything): a block the
device caches is told as stored ("GPU", with its tokens and parent), one it evicts as removed;
the lower tiers tell their own (kv/tiers.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

from prefixkv.kv.block_pool import BlockPool
from prefixkv.kv.events import FULL_ATTENTION, MEDIUM_GPU, SLIDING_WINDOW, KVEventLog
from prefixkv.kv.hashing import first_block_keys
from prefixkv.kv.keys import EvictedPage, LowerPage, PageKey, hash_blocks
from prefixkv.kv.managers import FullAttentionManager, SlidingWindowManager, Tables
from prefixkv.kv.radix import MatchResult, RadixIndex
from prefixkv.kv.retention import RetentionTable
from prefixkv.kv.tiers import TIER_DEVICE, TierConnector


class CopyOp(NamedTuple):
    src: int
    dst: int


class TableDelta(NamedTuple):
    """What changed in a request's tables since it was last taken: each group's ids from ``start``
    to its end (the tables' new length is ``start + len(blocks[g])``)."""

    start: int
    blocks: tuple[list[int], ...]


class KVCacheCoordinator:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: tuple[int | None, ...] = (None,), lower: TierConnector | None = None,
                 events: KVEventLog | None = None, max_retained_fraction: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.NULL = num_blocks  # the entry of a page given back before its window (the dummy page)
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = windows  # per KV cache group (kv/groups.py): its sliding window or None
        self.num_groups = len(windows)
        full = tuple(g for g, w in enumerate(windows) if w is None)
        by_window: dict[int, list[int]] = {}
        for g, w in enumerate(windows):
            if w is not None:
                by_window.setdefault(w, []).append(g)
        windowed = [SlidingWindowManager(self.pool, block_size, w, tuple(gs)) for w, gs in sorted(by_window.items())]
        # hit search: full attention first (its path bounds the rest); eviction: windowed first
        self.managers: list[FullAttentionManager | SlidingWindowManager] = \
            ([FullAttentionManager(self.pool, block_size, full)] if full else []) + windowed
        self._windowed = windowed
        self._eviction_order = windowed + self.managers[:len(self.managers) - len(windowed)]
        self._owner_of_group_0 = next(m for m in self.managers if 0 in m.group_ids)
        self.lower = lower if lower is not None and lower.enabled and enable_prefix_caching else None
        # retained prefixes: at most max_retained_fraction of the pool's blocks (a block: a page per group)
        self.retention = RetentionTable(int(max_retained_fraction * num_blocks) // self.num_groups, clock)
        if self.lower is not None:
            self.lower.spare(self.retention)
        self.events = events if enable_prefix_caching else None
        if self.events is not None and self.lower is not None:
            self.lower.attach_events(self.events)
        self.block_tables: dict[str, Tables] = {}
        self._dirty: dict[str, int] = {}  # seq_id -> first table index changed since it was last taken
        self._released: list[str] = []  # tables dropped since take_released
        # prefix-cache statistics (tokens)
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.num_lower_hit_tokens = 0

    @property
    def radix(self) -> RadixIndex | None:
        """The full-attention groups' radix index (None for a model whose every layer is windowed)."""
        m = self.managers[0]
        return m.tree if isinstance(m, FullAttentionManager) else None

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_reclaimable_blocks(self) -> int:
        return self.pool.num_free + self.pool.num_evictable

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_in_use

    @property
    def num_cached_blocks(self) -> int:
        """Pages the device caches hold (every group's)."""
        return sum(m.num_cached_pages for m in self.managers)

    @property
    def version(self) -> int:
        """Changes whenever a cached page comes or goes: equal versions, equal device matches."""
        return sum(m.version for m in self.managers)

    # ------------------------------------------------------------------ prefix hits
    def _no_hit(self) -> MatchResult:
        return MatchResult(tuple([] for _ in self.windows), 0)

    def match_prefix(self, token_ids: Sequence[int], hashes: list[int] | None = None, touch: bool = True,
                     lower: bool = False, root: int = 0) -> MatchResult:
        """The longest cached prefix usable for a request with these tokens: never all of them,
        because the last token must be computed for its logits. Every group has what the hit needs
        (every block of a full-attention group; a windowed group the blocks its window sees at
        the hit's end). With ``lower``, pages a lower tier holds count too (``MatchResult.lower``).

        ``hashes``: the request's block hashes so far (``Request.block_hashes``), extended in place
        as far as the search needs; ``root``: its chain's (``Request.cache_root``: its salt and
        partition), so that only blocks cached by requests of the same root match.
        ``touch=False`` leaves the LRU order alone. Takes no references: valid until the next
        allocation or eviction."""
        limit = (len(token_ids) - 1) // self.block_size if self.enable_prefix_caching else 0
        if limit <= 0:
            return self._no_hit()
        holds = self.lower.holds if lower and self.lower is not None else None
        hashes = [] if hashes is None else hashes
        probes = [m.probe(token_ids, hashes, limit, touch, holds, root) for m in self.managers]
        e = limit
        while True:  # each attention type shortens the hit to what it can serve, until all agree
            end = e
            for p in probes:
                end = p.longest(end)
            if end == e:
                break
            e = end
        if touch and e and self.retention:
            # a hit refreshes the retained prefixes it covers; one that reaches the limit covers
            # every full block of the tokens (the last one is recomputed only for its logits)
            n = len(token_ids) // self.block_size if e == limit else e
            self.retention.touch(hash_blocks(token_ids, hashes, n, self.block_size, root)[:n])
        blocks: list[list[int]] = [[] for _ in self.windows]
        lower_pages: list[LowerPage] = []
        for m, p in zip(self.managers, probes):
            pages, refs = p.take(e, self.NULL)
            for g, t in zip(m.group_ids, pages):
                blocks[g] = t
            lower_pages += refs
        return MatchResult(tuple(blocks), e * self.block_size, tuple(lower_pages))

    # ------------------------------------------------------------------ retention
    def retain(self, token_ids: Sequence[int], num_tokens: int, ttl_s: float, hashes: list[int] | None = None,
               root: int = 0, handle: str | None = None) -> None:
        """Spare the full blocks of ``token_ids[:num_tokens]`` (in the chain of ``root``; ``hashes``:
        the request's block hashes so far, extended here) from eviction until ``ttl_s`` seconds
        have passed since their last use, or ``handle`` is released (kv/retention.py). Nothing
        without prefix caching."""
        n = min(num_tokens, len(token_ids)) // self.block_size
        if not self.enable_prefix_caching or n <= 0:
            return
        hashes = hash_blocks(token_ids, [] if hashes is None else hashes, n, self.block_size, root)
        self.retention.retain(hashes[:n], ttl_s, handle)

    def release_retention(self, handle: str) -> bool:
        """``RetentionTable.release``: the retention asked under ``handle`` lets go before its TTL
        (its blocks stay cached, evicted by recency from now on, unless another retention covers
        them). False if ``handle`` holds none."""
        return self.retention.release(handle)

    def routing_digest(self) -> tuple[dict[int, int], list[int]]:
        """``cache_digest()``, and the hashes in it that a retained prefix covers now (their TTLs
        checked first): what a router counts as held whatever else the replica evicts. One walk
        of the caches for both."""
        self.retention.expire()
        digest = self.cache_digest()
        return digest, [h for h in self.retention.blocks if h in digest] if self.retention else []

    def retention_stats(self) -> dict[str, int]:
        """Retained blocks now (their TTLs checked first) and the retention counters."""
        r = self.retention
        r.expire()
        host = self.lower.host if self.lower is not None else None
        return {"num_kv_blocks_retained": r.num_blocks, "retention_lapsed": r.num_lapsed,
                "retention_expired": r.num_expired,
                "retained_blocks_evicted": r.num_evicted + (host.num_retained_pushed_out if host else 0)}

    # ------------------------------------------------------------------ tables
    def blocks_needed(self, seq_id: str, num_computed: int, num_new_tokens: int) -> int:
        tables = self.block_tables.get(seq_id)
        first = tables[0] if tables else ()
        bs = self.block_size
        need = -(-(num_computed + num_new_tokens) // bs) - len(first)
        if num_computed % bs and self.pool.ref_cnt[first[num_computed // bs]] > 1:
            need += 1  # copy-on-write of the shared partial block
        return max(need, 0) * self.num_groups  # a page of every group per block

    def allocate_slots(self, seq_id: str, num_computed: int, num_new_tokens: int, prefix: MatchResult | None = None,
                       reserve: int = 0) -> list[CopyOp] | None:
        """Make ``seq_id``'s tables cover ``num_computed + num_new_tokens`` tokens.

        ``prefix`` (admission only: a new table) is the hit the tables start with; ``num_computed``
        must equal its tokens. Its lower-tier pages get fresh device pages, copied in before the
        step (``TierConnector.take`` / ``load``). Leaves ``reserve`` pages reclaimable for others (a
        watermark). Returns the copy-on-write ops, or None if the pages cannot be had, in which case
        nothing changed (but pages out of a window were given back)."""
        bs = self.block_size
        tables = self.block_tables.get(seq_id)
        if tables is None:
            return self._allocate_new(seq_id, num_computed, num_new_tokens, prefix or self._no_hit(), reserve)
        for m in self._windowed:
            m.free_out_of_window(seq_id, tables, num_computed)
        first = tables[0]
        end = num_computed + num_new_tokens
        if end <= len(first) * bs and (not num_computed % bs or self.pool.ref_cnt[first[num_computed // bs]] == 1):
            return []  # the common decode step: room in its own last block
        need = self.blocks_needed(seq_id, num_computed, num_new_tokens)
        if need + reserve > self.num_reclaimable_blocks:
            return None
        if need > self.pool.num_free:
            self._evict(need - self.pool.num_free)
        ops = self._copy_on_write(seq_id, tables, num_computed)
        self._append(seq_id, tables, end)
        return ops

    def _allocate_new(self, seq_id: str, num_computed: int, num_new_tokens: int, prefix: MatchResult,
                      reserve: int) -> list[CopyOp] | None:
        assert prefix.num_tokens == num_computed, (prefix.num_tokens, num_computed)
        n = len(prefix.blocks[0])
        need = (max(0, -(-(num_computed + num_new_tokens) // self.block_size) - n) * self.num_groups
                + len(prefix.lower))
        ref_cnt, null = self.pool.ref_cnt, self.NULL
        locked = sum(1 for t in prefix.blocks for b in t if b != null and ref_cnt[b] == 1)  # evictable now, held then
        if need + reserve > self.num_reclaimable_blocks - locked:
            return None
        tables = self.block_tables[seq_id] = tuple(list(t) for t in prefix.blocks)
        for m in self.managers:
            m.adopt(seq_id, tables, num_computed)
        self._dirty[seq_id] = 0
        # (the lower tiers' slots are taken before evicting: the evicted pages' copies may not push them out)
        sources = self.lower.take(prefix.lower) if prefix.lower else None
        if need > self.pool.num_free:
            self._evict(need - self.pool.num_free)
        if sources is not None:
            pages = []
            for r in prefix.lower:
                pages.append(self.pool.allocate())
                tables[r.group][r.index] = pages[-1]
            self.lower.load(sources, pages)
        self._append(seq_id, tables, num_computed + num_new_tokens)
        return []

    def _copy_on_write(self, seq_id: str, tables: Tables, num_computed: int) -> list[CopyOp]:
        """A fork's shared partial block (shared in every group) gets a copy of its own."""
        bs = self.block_size
        i = num_computed // bs
        if not num_computed % bs or self.pool.ref_cnt[tables[0][i]] == 1:
            return []
        ops = []
        for t in tables:
            src, dst = t[i], self.pool.allocate()
            self.pool.decref(src)
            t[i] = dst
            ops.append(CopyOp(src, dst))
        self._mark(seq_id, i)
        return ops

    def _append(self, seq_id: str, tables: Tables, num_tokens: int) -> None:
        """Free pages appended (a block: a page of every group) until the tables cover ``num_tokens``."""
        first, bs = tables[0], self.block_size
        if len(first) * bs >= num_tokens:
            return
        self._mark(seq_id, len(first))
        allocate = self.pool.allocate
        while len(first) * bs < num_tokens:
            for t in tables:
                t.append(allocate())

    def free_out_of_window(self, seq_id: str, num_computed: int) -> None:
        """Give back each windowed group's pages that lie wholly before its window once
        ``num_computed`` tokens are computed (``allocate_slots`` does it for a scheduled request)."""
        for m in self._windowed:
            m.free_out_of_window(seq_id, self.block_tables[seq_id], num_computed)

    def cache_blocks(self, seq_id: str, token_ids: Sequence[int], num_computed: int,
                     hashes: list[int] | None = None, root: int = 0, cache_salt: str | None = None,
                     partition: str | None = None) -> None:
        """Offer the caches the request's blocks that are full once ``num_computed`` tokens are
        computed. ``hashes``: its block hashes so far (``Request.block_hashes``, a chain from
        ``root``: ``Request.cache_root``, of ``cache_salt`` and ``partition``), extended here."""
        if not self.enable_prefix_caching:
            return
        num_full = num_computed // self.block_size
        if all(m.num_indexed[seq_id] >= num_full for m in self.managers):
            return
        hashes = hash_blocks(token_ids, [] if hashes is None else hashes, num_full, self.block_size, root)
        tables = self.block_tables[seq_id]
        events = self.events
        for m in self.managers:
            new = m.cache(seq_id, tables, token_ids, hashes, num_full, root)
            if events is not None and new:
                self._tell_cached(m, token_ids, hashes, new, cache_salt, partition)

    def _tell_cached(self, m: FullAttentionManager | SlidingWindowManager, token_ids: Sequence[int],
                     hashes: Sequence[int], new: Sequence[int], cache_salt: str | None, partition: str | None) -> None:
        """KV events: the blocks ``new`` (ascending indices) that ``m`` just cached, a run of
        consecutive ones per event, for each of its groups."""
        hash_keys, extra_keys = first_block_keys(cache_salt, partition), first_block_keys(cache_salt)
        kind, window = (SLIDING_WINDOW, m.window) if m.windowed else (FULL_ATTENTION, None)
        runs, start = [], new[0]
        for a, b in zip(new, new[1:]):
            if b != a + 1:
                runs.append((start, a + 1))
                start = b
        runs.append((start, new[-1] + 1))
        for g in m.group_ids:
            for lo, hi in runs:
                self.events.cached(token_ids, hashes, lo, hi, hash_keys, extra_keys, group_idx=g,
                                   kv_cache_spec_kind=kind, sliding_window=window)

    def extend(self, seq_id: str, num_tokens: int, reserve: int = 0) -> bool:
        """Append free pages (never evicting, leaving ``reserve`` free) until the tables cover
        ``num_tokens``; for a speculative draft after the step's own allocation (which did any
        copy-on-write). False, and nothing changed, if the free pages do not suffice."""
        tables = self.block_tables[seq_id]
        need = -(-num_tokens // self.block_size) - len(tables[0])
        if need * self.num_groups + reserve > self.pool.num_free:
            return False
        self._append(seq_id, tables, num_tokens)
        return True

    def trim(self, seq_id: str, num_tokens: int) -> None:
        """Free the blocks past the first ``num_tokens`` tokens (a rejected speculative draft's):
        they hold nothing verified, so they are in no cache and shared with nobody."""
        tables = self.block_tables[seq_id]
        keep = -(-num_tokens // self.block_size)
        if len(tables[0]) > keep:
            self._mark(seq_id, keep)
        for t in tables:
            while len(t) > keep:
                b = t.pop()
                assert self.pool.ref_cnt[b] == 1 and not self.pool.cached[b], (seq_id, b)
                self.pool.decref(b)

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every page of the parent (the partial last block's included)."""
        tables = self.block_tables[parent_id]
        for m in self.managers:
            m.fork(parent_id, child_id, tables)
        self.block_tables[child_id] = tuple(list(t) for t in tables)
        self._dirty[child_id] = 0

    def free(self, seq_id: str) -> None:
        """Drop a request's tables. Its cached pages stay cached (evictable); the rest go back to
        the free list."""
        tables = self.block_tables.pop(seq_id, None)
        if tables is None:
            return
        self._dirty.pop(seq_id, None)
        self._released.append(seq_id)
        for m in self.managers:
            m.release(seq_id, tables)

    def _mark(self, seq_id: str, index: int) -> None:
        d = self._dirty.get(seq_id)
        if d is None or index < d:
            self._dirty[seq_id] = index

    def take_table_deltas(self, seq_ids: list[str]) -> list[TableDelta | None]:
        """What changed in each of these requests' tables since they were last taken, or None if
        nothing did."""
        pop, tables = self._dirty.pop, self.block_tables
        out: list[TableDelta | None] = []
        for sid in seq_ids:
            d = pop(sid, None)
            out.append(None if d is None else TableDelta(d, tuple(t[d:] for t in tables[sid])))
        return out

    def take_released(self) -> list[str]:
        """The seq_ids whose tables were dropped since the last call."""
        out, self._released = self._released, []
        return out

    # ------------------------------------------------------------------ eviction
    def evict(self, num_pages: int) -> list[int]:
        """Free up to ``num_pages`` cached pages that no request holds (a unit may go over by its
        size - 1), oldest first; a lower tier gets their copies. Returns the freed pages."""
        return [e.page for e in self._evict(num_pages)]

    def _evict(self, num_pages: int, save: bool = True) -> list[EvictedPage]:
        """Oldest first, sparing retained blocks while others can go (only when ``save``: a reset
        drops everything); then, if still short, retained ones too (``RetentionTable.num_evicted``)."""
        retention = self.retention
        retention.expire()
        spare = retention if save and retention else None
        freed = self._evict_pass(num_pages, spare)
        if spare is not None and len(freed) < num_pages:
            more = self._evict_pass(num_pages - len(freed), None)
            retention.num_evicted += sum(1 for e in more if e.key[0] in retention)
            freed += more
        if save and freed and self.lower is not None:
            self.lower.save(freed)  # (before the device's drop is told: the copies keep their hashes known)
        if self.events is not None and freed:
            by_group: dict[int, list[int]] = {}
            for e in freed:
                by_group.setdefault(e.key[1], []).append(e.key[0])
            for g, hs in by_group.items():
                self.events.dropped(hs, MEDIUM_GPU, g)
        return freed

    def _evict_pass(self, num_pages: int, retained: RetentionTable | None) -> list[EvictedPage]:
        freed: list[EvictedPage] = []
        order = self._eviction_order
        try:
            while len(freed) < num_pages:
                best, best_time = None, 0
                for m in order:  # the oldest unit of any attention type; windowed ones first on a tie
                    t = m.eviction_head(retained)
                    if t is not None and (best is None or t < best_time):
                        best, best_time = m, t
                if best is None:
                    break
                freed += best.evict_next()
        finally:
            for m in order:
                m.end_eviction()
        return freed

    def reset_cache(self) -> int:
        """Drop every cached page no request holds, without copies to a lower tier (after a failed
        step: their KV can no longer be trusted). Returns how many."""
        return len(self._evict(self.pool.num_blocks, save=False))

    # ------------------------------------------------------------------ views
    def record_query(self, num_queried: int, num_hit: int, num_lower_hit: int = 0) -> None:
        """``num_hit`` counts every cached token found, ``num_lower_hit`` those a lower tier gave."""
        self.num_queried_tokens += num_queried
        self.num_hit_tokens += num_hit
        self.num_lower_hit_tokens += num_lower_hit

    def cached_pages(self) -> Iterator[tuple[int, PageKey, tuple[int, ...]]]:
        """(page, key, the tokens its KV holds) of every page the device caches hold."""
        for m in self.managers:
            yield from m.cached_pages()

    def cached_blocks(self) -> dict[int, tuple[int, ...]]:
        """page -> the tokens its KV holds, for every cached page."""
        return {p: tokens for p, _, tokens in self.cached_pages()}

    def cache_digest(self) -> dict[int, int]:
        """block hash -> tier (kv/tiers.py ``TIER_*``: the highest that holds it) of every cached
        block (group 0's pages): which prefixes this engine can serve from cache, for a router
        (serve/router.py matches a request's block hashes against it)."""
        out = self.lower.digest() if self.lower is not None else {}
        out.update(dict.fromkeys(self._owner_of_group_0.block_hashes(), TIER_DEVICE))
        return out

    def summary(self, **kw) -> dict:
        """The top of the radix index (``RadixIndex.summary``); an empty tree where every layer is
        windowed (their pages are cached by hash, not in a tree)."""
        if self.radix is not None:
            return self.radix.summary(**kw)
        return {"num_nodes": 0, "num_cached_blocks": self.num_cached_blocks, "num_shown_nodes": 0,
                "root": {"num_children": 0, "children": []}}

    def check_integrity(self) -> None:
        """free + evictable + in use == total; every ref count equals its holders (the request
        tables and the caches); each manager's own invariants; the lower tiers'."""
        self.pool.check_integrity()
        self.retention.check_integrity()
        null = self.NULL
        for m in self.managers:
            m.check_integrity(self.block_tables, null)
        if self.lower is not None:
            self.lower.check_integrity()
        holders = [0] * self.pool.num_blocks
        for p, _, _ in self.cached_pages():
            holders[p] += 1
        assert holders == [1 if c else 0 for c in self.pool.cached], "pool's cached flags != the caches' pages"
        for seq_id, tables in self.block_tables.items():
            assert len(tables) == self.num_groups and all(len(t) == len(tables[0]) for t in tables), \
                f"{seq_id}: group tables of different lengths: {tables}"
            pages = [b for t in tables for b in t if b != null]
            assert len(set(pages)) == len(pages), f"{seq_id} holds a page twice: {tables}"
            for b in pages:
                holders[b] += 1
        bad = {b: (self.pool.ref_cnt[b], h) for b, h in enumerate(holders) if self.pool.ref_cnt[b] != h}
        assert not bad, f"ref_cnt != holders for pages {{id: (ref_cnt, holders)}} {bad}"
