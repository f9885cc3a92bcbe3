"""One manager per attention type over the block pool. No torch.

A manager knows, for the KV cache groups of its attention type, which pages a prefix hit needs,
which pages a request holds, and how its cached pages are kept and evicted::

    FullAttentionManager   a hit of e blocks needs blocks 0 .. e-1 of each of its groups; its
                           cached pages live in the radix index (kv/radix.py)
    SlidingWindowManager   a hit of e blocks needs only what a query at position e * block_size
                           sees: blocks window_start(e) .. e-1 (kv/groups.py); a request gives its
                           pages before the window back as it advances (``NULL`` in its table:
                           vLLM's null block), and cached pages live in a map by block hash

The coordinator (kv/coordinator.py) owns every request's tables (one per group, all as long as
each other) and calls a manager with them; a manager changes only its own groups' entries. Every
manager caches the pages of a block together (a *unit*: one page of each of its groups) and
evicts them together, stamped with the pool's LRU clock.

Hit search goes through a probe (``manager.probe(...)``): ``longest(e)`` is the longest hit of at
most e blocks this type can serve (from the device or, given ``holds``, from a lower tier), and
``take(e)`` its pages. The coordinator shrinks e until every probe agrees.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container, Sequence
from typing import NamedTuple

from prefixkv.kv.block_pool import BlockPool
from prefixkv.kv.groups import window_start
from prefixkv.kv.keys import EvictedPage, LowerPage, PageKey, hash_blocks
from prefixkv.kv.radix import RadixIndex

Holds = Callable[[PageKey, tuple[int, ...]], bool]  # whether a lower tier holds a page (kv/tiers.py)
Tables = tuple[list[int], ...]  # a request's block table of every group


class FullAttentionManager:
    """Full attention: every block of the context, in every step; cached in the radix index."""

    windowed = False

    def __init__(self, pool: BlockPool, block_size: int, group_ids: tuple[int, ...]) -> None:
        self.pool = pool
        self.block_size = block_size
        self.group_ids = group_ids
        self.tree = RadixIndex(pool, block_size, group_ids)
        # how many leading blocks of each request's tables the tree holds (inserted or matched)
        self.num_indexed: dict[str, int] = {}

    @property
    def version(self) -> int:
        return self.tree.version

    @property
    def num_cached_pages(self) -> int:
        return self.tree.num_cached_blocks

    def probe(self, token_ids: Sequence[int], hashes: list[int], limit: int, touch: bool,
              holds: Holds | None, root: int = 0) -> "_FullProbe":
        return _FullProbe(self, token_ids, hashes, limit, touch, holds, root)

    def adopt(self, seq_id: str, tables: Tables, num_computed: int) -> None:
        """A new request's tables start with a hit: the tree's pages, then (``NULL`` placeholders,
        filled in later) the pages a lower tier supplies."""
        first, null = tables[self.group_ids[0]], self.pool.num_blocks
        try:
            num_device = first.index(null)
        except ValueError:
            num_device = len(first)
        incref = self.pool.incref
        for g in self.group_ids:
            for b in tables[g][:num_device]:
                incref(b)
        self.num_indexed[seq_id] = num_device

    def cache(self, seq_id: str, tables: Tables, token_ids: Sequence[int], hashes: list[int], num_full: int,
              root: int = 0) -> range:
        """Insert the request's blocks that are full once ``num_full`` blocks are (``hashes``: their
        chain from ``root``): a path that stopped at a duplicate block (see RadixIndex.insert) stays
        stopped, since the block before the new ones is then not the tree's. Returns the indices
        of the blocks newly cached."""
        done = self.num_indexed[seq_id]
        if num_full <= done:
            return range(0)
        first = tables[self.group_ids[0]]
        n = 0
        if not done or self.pool.cached[first[done - 1]]:
            n = self.tree.insert(token_ids, [tables[g] for g in self.group_ids], num_done=done, num_blocks=num_full,
                                 hashes=hashes, root=root)
        self.num_indexed[seq_id] = num_full
        return range(num_full - n, num_full)

    def free_out_of_window(self, seq_id: str, tables: Tables, num_computed: int) -> None:
        """(Nothing is out of a full-attention window.)"""

    def release(self, seq_id: str, tables: Tables) -> None:
        """The request lets go of its pages, tail first (cached ones stay in the tree, evictable)."""
        self.num_indexed.pop(seq_id)
        for g in self.group_ids:
            for b in reversed(tables[g]):
                self.pool.decref(b)

    def fork(self, parent_id: str, child_id: str, tables: Tables) -> None:
        for g in self.group_ids:
            for b in tables[g]:
                self.pool.incref(b)
        self.num_indexed[child_id] = self.num_indexed[parent_id]

    # eviction: the tree's one rule (least recently used leaf, tail block first)
    def eviction_head(self, retained: Container[int] | None = None) -> int | None:
        return self.tree.eviction_head(retained)

    def evict_next(self) -> list[EvictedPage]:
        return self.tree.evict_next()

    def end_eviction(self) -> None:
        self.tree.end_eviction()

    def cached_pages(self):
        return self.tree.cached_pages()

    def block_hashes(self):
        return self.tree.block_hashes()

    def check_integrity(self, tables: dict[str, Tables], null: int) -> None:
        self.tree.check_integrity()
        for seq_id, t in tables.items():
            for g in self.group_ids:
                assert null not in t[g], f"{seq_id} lacks a page of full-attention group {g}: {t[g]}"
            n = self.num_indexed[seq_id]
            assert n <= len(t[self.group_ids[0]]), (seq_id, n, t)


class _FullProbe:
    """The tree's path for the hit (device pages), then the blocks a lower tier holds right after
    it (every group's page of each)."""

    __slots__ = ("group_ids", "pages", "num_device", "num_blocks", "lower")

    def __init__(self, m: FullAttentionManager, token_ids: Sequence[int], hashes: list[int], limit: int,
                 touch: bool, holds: Holds | None, root: int) -> None:
        bs = m.block_size
        self.group_ids = m.group_ids
        self.pages = m.tree.match(token_ids, touch, limit * bs, root).blocks
        n = self.num_device = len(self.pages[0])
        self.lower: list[LowerPage] = []
        if holds is not None:
            while n < limit:
                hash_blocks(token_ids, hashes, n + 1, bs, root)
                tokens = tuple(token_ids[n * bs:(n + 1) * bs])
                if not all(holds((hashes[n], g), tokens) for g in m.group_ids):
                    break
                self.lower.extend(LowerPage(g, n, (hashes[n], g), tokens) for g in m.group_ids)
                n += 1
        self.num_blocks = n

    def longest(self, e: int) -> int:
        return min(e, self.num_blocks)

    def take(self, e: int, null: int) -> tuple[list[list[int]], list[LowerPage]]:
        d = min(e, self.num_device)
        return ([p[:d] + [null] * (e - d) for p in self.pages],
                [r for r in self.lower if r.index < e])


class CachedUnit(NamedTuple):
    pages: tuple[int, ...]  # one per group of the manager
    tokens: tuple[int, ...]  # the block's tokens (checked on every hit: a hash collision never matches)


class SlidingWindowManager:
    """Sliding-window attention (one window size): a request holds only the blocks its next query
    sees; cached units live in a map by block hash, and those that only the map holds are evicted
    in the order they were last let go of (vLLM's free queue)."""

    windowed = True

    def __init__(self, pool: BlockPool, block_size: int, window: int, group_ids: tuple[int, ...]) -> None:
        self.pool = pool
        self.block_size = block_size
        self.window = window
        self.group_ids = group_ids
        self.cached: dict[int, CachedUnit] = {}  # block hash -> its pages
        self._page_hash: dict[int, int] = {}  # a cached unit's first page -> its block hash
        # units only the map holds, in the order that happened, with the pool's clock then
        self._evictable: OrderedDict[int, int] = OrderedDict()
        self.win_start: dict[str, int] = {}  # per request: its first block not given back yet
        self.num_indexed: dict[str, int] = {}  # per request: blocks before this one were offered to the map
        self.version = 0
        self._parked: list[tuple[int, int]] = []  # retained units the running eviction set aside

    @property
    def num_cached_pages(self) -> int:
        return len(self.cached) * len(self.group_ids)

    def start(self, num_computed: int) -> int:
        """The first block this window still needs once ``num_computed`` tokens are computed."""
        return window_start(self.window, num_computed, self.block_size)

    def probe(self, token_ids: Sequence[int], hashes: list[int], limit: int, touch: bool,
              holds: Holds | None, root: int = 0) -> "_WindowProbe":
        return _WindowProbe(self, token_ids, hashes, holds, root)

    def adopt(self, seq_id: str, tables: Tables, num_computed: int) -> None:
        """A new request's tables start with a hit: it takes hold of the hit's cached units."""
        start = self.win_start[seq_id] = self.num_indexed[seq_id] = self.start(num_computed)
        first = tables[self.group_ids[0]]
        for i in range(start, len(first)):
            if first[i] == self.pool.num_blocks:
                continue  # (a lower tier's page, filled in later)
            for g in self.group_ids:
                self.pool.incref(tables[g][i])
            self._evictable.pop(self._page_hash.get(first[i]), None)

    def cache(self, seq_id: str, tables: Tables, token_ids: Sequence[int], hashes: list[int], num_full: int,
              root: int = 0) -> list[int]:
        """Offer the map the request's blocks that are full once ``num_full`` blocks are (those it
        holds: in its window). A block the map already has (same hash) stays the map's. Returns
        the indices of the blocks newly cached."""
        bs, null = self.block_size, self.pool.num_blocks
        first = tables[self.group_ids[0]]
        new = []
        for i in range(self.num_indexed[seq_id], num_full):
            if first[i] == null or hashes[i] in self.cached:
                continue
            pages = tuple(tables[g][i] for g in self.group_ids)
            for p in pages:
                self.pool.pin(p)
            self.cached[hashes[i]] = CachedUnit(pages, tuple(token_ids[i * bs:(i + 1) * bs]))
            self._page_hash[pages[0]] = hashes[i]
            self.version += 1
            new.append(i)
        self.num_indexed[seq_id] = max(self.num_indexed[seq_id], num_full)
        return new

    def free_out_of_window(self, seq_id: str, tables: Tables, num_computed: int) -> None:
        """Give back the pages that lie wholly before the window once ``num_computed`` tokens are
        computed (the runner's copy of the table keeps their stale ids: no kernel reads them)."""
        start, end = self.win_start[seq_id], self.start(num_computed)
        if end <= start:
            return
        for i in range(start, end):
            self._let_go(tables, i)
        self.win_start[seq_id] = end

    def _let_go(self, tables: Tables, i: int) -> None:
        null = self.pool.num_blocks
        first = tables[self.group_ids[0]][i]
        if first == null:
            return
        for g in self.group_ids:
            self.pool.decref(tables[g][i])
            tables[g][i] = null
        h = self._page_hash.get(first)
        if h is not None and self.pool.ref_cnt[first] == 1:
            self._evictable[h] = self.pool.clock

    def release(self, seq_id: str, tables: Tables) -> None:
        """The request lets go of its pages, earliest first (so the map's copies become
        evictable in that order: the window's end last)."""
        start = self.win_start.pop(seq_id)
        self.num_indexed.pop(seq_id)
        for i in range(start, len(tables[self.group_ids[0]])):
            self._let_go(tables, i)

    def fork(self, parent_id: str, child_id: str, tables: Tables) -> None:
        null = self.pool.num_blocks
        for g in self.group_ids:
            for b in tables[g]:
                if b != null:
                    self.pool.incref(b)
        self.win_start[child_id] = self.win_start[parent_id]
        self.num_indexed[child_id] = self.num_indexed[parent_id]

    # eviction: the unit let go of longest ago
    def eviction_head(self, retained: Container[int] | None = None) -> int | None:
        """The clock stamp of the unit ``evict_next`` takes; units whose hash is in ``retained``
        (kv/retention.py) are set aside until ``end_eviction``."""
        q = self._evictable
        if retained:
            while q:
                h = next(iter(q))
                if h not in retained:
                    break
                self._parked.append((h, q.pop(h)))
        return next(iter(q.values()), None)

    def evict_next(self) -> list[EvictedPage]:
        h, _ = self._evictable.popitem(last=False)
        unit = self.cached.pop(h)
        del self._page_hash[unit.pages[0]]
        for p in unit.pages:
            self.pool.unpin(p)
        self.version += 1
        return [EvictedPage(p, (h, g), unit.tokens) for p, g in zip(unit.pages, self.group_ids)]

    def end_eviction(self) -> None:
        """Put the units set aside back at the front of the queue, in their order."""
        q = self._evictable
        for h, stamp in reversed(self._parked):
            q[h] = stamp
            q.move_to_end(h, last=False)
        self._parked.clear()

    def cached_pages(self):
        for h, unit in self.cached.items():
            for p, g in zip(unit.pages, self.group_ids):
                yield p, (h, g), unit.tokens

    def block_hashes(self):
        return iter(self.cached)

    def check_integrity(self, tables: dict[str, Tables], null: int) -> None:
        ref_cnt, cached = self.pool.ref_cnt, self.pool.cached
        for h, unit in self.cached.items():
            assert len(unit.pages) == len(self.group_ids) and all(cached[p] for p in unit.pages), (h, unit)
            assert self._page_hash.get(unit.pages[0]) == h, f"unit {h}: page -> hash map is stale"
            free = [ref_cnt[p] == 1 for p in unit.pages]
            assert all(free) or not any(free), f"unit {h}'s pages held apart: {[ref_cnt[p] for p in unit.pages]}"
            assert free[0] == (h in self._evictable), \
                f"unit {h}: ref_cnt {ref_cnt[unit.pages[0]]} but {'' if h in self._evictable else 'not '}queued"
        assert len(self._page_hash) == len(self.cached) and set(self._evictable) <= set(self.cached)
        stamps = list(self._evictable.values())
        assert stamps == sorted(stamps), "the eviction queue is out of LRU order"
        for seq_id, t in tables.items():
            start = self.win_start[seq_id]
            for g in self.group_ids:
                assert all(b == null for b in t[g][:start]), f"{seq_id} holds group {g}'s pages before its window"
                assert null not in t[g][start:], f"{seq_id} lacks a page of group {g} inside its window: {t[g]}"


class _WindowProbe:
    """Which blocks the window can have for a hit: each block's unit from the device map, or its
    pages from a lower tier, looked up once per probe."""

    __slots__ = ("m", "token_ids", "hashes", "holds", "root", "_at")

    def __init__(self, m: SlidingWindowManager, token_ids: Sequence[int], hashes: list[int],
                 holds: Holds | None, root: int) -> None:
        self.m, self.token_ids, self.hashes, self.holds, self.root = m, token_ids, hashes, holds, root
        self._at: dict[int, CachedUnit | tuple[int, ...] | None] = {}  # block -> unit, its tokens (lower), None

    def _where(self, i: int) -> CachedUnit | tuple[int, ...] | None:
        hit = self._at.get(i, False)
        if hit is not False:
            return hit
        bs, m = self.m.block_size, self.m
        hash_blocks(self.token_ids, self.hashes, i + 1, bs, self.root)
        h, tokens = self.hashes[i], tuple(self.token_ids[i * bs:(i + 1) * bs])
        unit = m.cached.get(h)
        if unit is not None and unit.tokens == tokens:
            hit = unit
        elif self.holds is not None and all(self.holds((h, g), tokens) for g in m.group_ids):
            hit = tokens
        else:
            hit = None
        self._at[i] = hit
        return hit

    def longest(self, e: int) -> int:
        """The longest hit of at most ``e`` blocks whose window blocks are all to be had: scanned
        from its end down; a missing block i rules out every end in (i, i + window], so the next
        candidate ends at i."""
        while e > 0:
            for i in range(e - 1, self.m.start(e * self.m.block_size) - 1, -1):
                if self._where(i) is None:
                    e = i
                    break
            else:
                return e
        return 0

    def take(self, e: int, null: int) -> tuple[list[list[int]], list[LowerPage]]:
        m = self.m
        pages = [[null] * e for _ in m.group_ids]
        lower = []
        for i in range(m.start(e * m.block_size), e):
            hit = self._where(i)
            if isinstance(hit, CachedUnit):
                for k, p in enumerate(hit.pages):
                    pages[k][i] = p
            else:
                lower.extend(LowerPage(g, i, (self.hashes[i], g), hit) for g in m.group_ids)
        return pages, lower
