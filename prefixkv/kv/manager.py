"""Per-request block tables over the block pool and the radix index. No torch.

A request's block table covers its computed tokens plus the tokens scheduled this step::

    token positions  0 ........................................ num_tokens
    blocks           [ full | full | full (cached in tree) | partial ]
                     <- num_indexed_blocks (in the tree) -><- its own ->

Copy-on-write: a block with ref_cnt > 1 is never written. Only a partial block can be written
into (full blocks are complete), and only forks (n > 1) share a partial block; before a request
writes into a shared partial block it gets a fresh copy and a ``CopyOp(src, dst)`` is emitted for
the runner to apply before the forward pass.

The runner keeps its own copy of every live table (a persistent array, as vLLM's
``BlockTable``); ``take_table_deltas`` tells it what changed since a request was last
scheduled (first changed index, the ids from there), and ``take_released`` which tables
were dropped, so a step hands over the new blocks only, never whole tables.

KV cache groups (kv/groups.py, ``windows`` given): a request has one table per group, all as long
as each other (``block_tables`` holds the anchor group's, ``extra_tables`` the others'); a block
takes one page of every group, and a copy-on-write copies each. Before a request is scheduled
from ``num_computed`` tokens, each windowed group's pages wholly before its window
(``RadixIndex.window_start``) go back: the entry becomes ``NULL`` (the dummy page), the runner's
copy keeps the stale id (no kernel reads before a window), and a page the tree also holds becomes
evictable on its own. Every count here (``num_blocks``, free, evictable, needed) is in pages.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from prefixkv.kv.block_pool import BlockPool
from prefixkv.kv.disk_cache import DiskBlockIndex
from prefixkv.kv.host_cache import HostBlockCache
from prefixkv.kv.radix import MatchResult, RadixIndex, block_hash

TIER_DEVICE, TIER_HOST, TIER_DISK = 0, 1, 2  # where a cached block is (cache_digest)


class CopyOp(NamedTuple):
    src: int
    dst: int


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0, num_disk_blocks: int = 0,
                 windows: tuple[int | None, ...] = (None,)) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.radix = RadixIndex(self.pool, block_size, windows)
        self.enable_prefix_caching = enable_prefix_caching
        # KV cache groups: per group its window (None: full attention); group 0 is the anchor
        self.windows = windows
        self.num_groups = len(windows)
        self.grouped = self.num_groups > 1 or windows[0] is not None
        self.windowed = [(g, w) for g, w in enumerate(windows) if w is not None]
        self.NULL = num_blocks  # the entry of a page freed out of its group's window
        if self.grouped and (num_host_blocks or num_disk_blocks):
            raise ValueError("kv_host_cache_gb: the host and disk tiers keep whole blocks; with sliding-window "
                             "KV groups they are not supported yet (disable_hybrid_kv_cache_manager keeps every "
                             "layer's KV in one group)")
        self.extra_tables: dict[str, tuple[list[int], ...]] = {}  # groups after the anchor
        self._win_start: dict[str, list[int]] = {}  # per group: its first entry not yet freed
        self._stopped: set[str] = set()  # tables whose insertion stopped at a duplicate block
        # the host tier (kv/host_cache.py): evicted cached blocks are copied there, and matched back
        self.host = HostBlockCache(num_host_blocks) if num_host_blocks and enable_prefix_caching else None
        self._swap_out: list[tuple[int, int]] = []  # (device block, host slot): copy before the step
        self._swap_in: list[tuple[int, int]] = []  # (host slot, device block): copy after the swap-outs
        # the disk tier (kv/disk_cache.py), under the host tier: blocks the host tier lets go of
        self.disk = DiskBlockIndex(num_disk_blocks) if num_disk_blocks and self.host is not None else None
        self._spill: list[tuple[int, int, tuple[int, ...]]] = []  # (host slot, key, tokens): write first
        self._load: list[tuple[int, int]] = []  # (key, device block): read after the swap-ins
        self._disk_drop: list[int] = []  # keys whose files go, last
        self.block_tables: dict[str, list[int]] = {}
        # How many leading blocks of each table the radix index holds (inserted or matched).
        # (RadixIndex.num_cached_blocks counts the tree's blocks; BlockPool.num_evictable those
        # only the tree holds.)
        self.num_indexed_blocks: dict[str, int] = {}
        # seq_id -> first table index changed since take_table_deltas last reported it
        self._dirty: dict[str, int] = {}
        self._released: list[str] = []  # tables dropped since take_released
        # Prefix-cache statistics (tokens).
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.num_host_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_reclaimable_blocks(self) -> int:
        return self.pool.num_free + self.pool.num_evictable

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_in_use

    def match_prefix(self, token_ids: Sequence[int], touch: bool = True) -> MatchResult:
        """Cached prefix usable for a request with these tokens: never all of them, because the
        last token must be computed for its logits. ``touch=False`` leaves the LRU order alone."""
        if not self.enable_prefix_caching or len(token_ids) <= 1:
            return MatchResult([], 0)
        return self.radix.match(token_ids[:len(token_ids) - 1], touch=touch)

    def blocks_needed(self, seq_id: str, num_computed: int, num_new_tokens: int) -> int:
        table = self.block_tables.get(seq_id, ())
        bs = self.block_size
        need = -(-(num_computed + num_new_tokens) // bs) - len(table)
        if num_computed % bs and self.pool.ref_cnt[table[num_computed // bs]] > 1:
            need += 1  # copy-on-write of the shared partial block
        return max(need, 0) * self.num_groups  # a page of every group per block

    def allocate_slots(
        self,
        seq_id: str,
        num_computed: int,
        num_new_tokens: int,
        prefix: MatchResult | None = None,
        reserve: int = 0,
        host_keys: Sequence[int] = (),
    ) -> list[CopyOp] | None:
        """Make ``seq_id``'s table cover ``num_computed + num_new_tokens`` tokens.

        ``prefix`` (admission only) gives the matched cached blocks that start the table, and
        ``host_keys`` (``match_host``) the host-tier blocks that follow them (fresh device blocks,
        copied in before the step); ``num_computed`` must then equal the tokens of both. Leaves ``reserve`` blocks
        reclaimable for others (a watermark). Returns the copy-on-write ops, or None if the blocks
        cannot be had, in which case nothing changed (but pages out of a window were given back).
        """
        bs = self.block_size
        new_table = seq_id not in self.block_tables
        if new_table:
            prefix = prefix or MatchResult([], 0)
            assert prefix.num_tokens + len(host_keys) * bs == num_computed, (prefix.num_tokens, num_computed)
            if self.grouped:
                self._adopt(seq_id, prefix, num_computed)
            else:
                for b in prefix.block_ids:
                    self.pool.incref(b)
                self.block_tables[seq_id] = list(prefix.block_ids)
            self.num_indexed_blocks[seq_id] = len(prefix.block_ids)
            self._dirty[seq_id] = 0
        elif self.windowed:
            self.free_out_of_window(seq_id, num_computed)
        table = self.block_tables[seq_id]
        if (not new_table and num_computed + num_new_tokens <= len(table) * bs
                and (not num_computed % bs or self.pool.ref_cnt[table[num_computed // bs]] == 1)):
            return []  # the common decode step: room in its own last block
        need = self.blocks_needed(seq_id, num_computed, num_new_tokens)
        if need + reserve > self.num_reclaimable_blocks:
            if new_table:
                self._release(seq_id, report=False)  # nobody saw this table
            return None
        if host_keys:  # host slots stay reserved until the copy-in has run; disk files stay
            sources = [("host", self.host.take(k)) if self.host.lookup_key(k) is not None else ("disk", k)
                       for k in host_keys]
        if need > self.pool.num_free:
            self._evict(need - self.pool.num_free)
        if host_keys:
            for tier, src in sources:
                b = self.pool.allocate()
                if tier == "disk":
                    self._load.append((src, b))
                else:
                    self._swap_in.append((src, b))
                table.append(b)
        ops: list[CopyOp] = []
        tables = self._tables(seq_id)
        if num_computed % bs:
            i = num_computed // bs
            if self.pool.ref_cnt[table[i]] > 1:  # (a fork's shared partial block: shared in every group)
                for t in tables:
                    src = t[i]
                    dst = self.pool.allocate()
                    self.pool.decref(src)
                    t[i] = dst
                    ops.append(CopyOp(src, dst))
                self._mark(seq_id, i)
        if len(table) * bs < num_computed + num_new_tokens:
            self._mark(seq_id, len(table))
            while len(table) * bs < num_computed + num_new_tokens:
                for t in tables:
                    t.append(self.pool.allocate())
        return ops

    def _tables(self, seq_id: str) -> tuple[list[int], ...]:
        """The request's table of every group (the anchor's first)."""
        table = self.block_tables[seq_id]
        return (table, *self.extra_tables[seq_id]) if self.grouped else (table,)

    def _adopt(self, seq_id: str, prefix: MatchResult, num_computed: int) -> None:
        """A new table per group from a match (NULL before each windowed group's window)."""
        NULL, incref = self.NULL, self.pool.incref
        extra = prefix.extra or tuple([] for _ in range(self.num_groups - 1))
        groups = (list(prefix.block_ids), *(list(e) for e in extra))
        assert len(groups) == self.num_groups and all(len(t) == len(groups[0]) for t in groups)
        for t in groups:
            for b in t:
                if b != NULL:
                    incref(b)
        self.block_tables[seq_id] = groups[0]
        self.extra_tables[seq_id] = tuple(groups[1:])
        self._win_start[seq_id] = [self.radix.window_start(w, num_computed) if w is not None else 0
                                   for w in self.windows]

    def free_out_of_window(self, seq_id: str, num_computed: int) -> int:
        """Give back the pages of each windowed group that lie wholly before its window, once
        ``num_computed`` tokens are computed. Returns how many pages this freed or released."""
        starts = self._win_start[seq_id]
        tables = self._tables(seq_id)
        n = 0
        for g, w in self.windowed:
            end = self.radix.window_start(w, num_computed)
            t = tables[g]
            for i in range(starts[g], min(end, len(t))):
                b = t[i]
                if b != self.NULL:
                    t[i] = self.NULL
                    self._drop(b)
                    n += 1
            if end > starts[g]:
                starts[g] = end
        return n

    def _drop(self, page: int) -> None:
        """A request lets go of a windowed group's page (the tree may keep it, evictable)."""
        self.pool.decref(page)
        if self.pool.cached[page] and self.pool.ref_cnt[page] == 1:
            self.radix.note_released(page)

    def _evict(self, num_blocks: int) -> None:
        """Free cached blocks from the device pool; with a host tier, each goes there first."""
        if self.host is None:
            self.radix.evict(num_blocks)
            return
        for b, key, tokens in self.radix.evict_with_keys(num_blocks):
            slot, pushed_out = self.host.put(key, tokens)
            if pushed_out is not None and self.disk is not None and pushed_out[0] not in self.disk:
                spilled = pushed_out[0]
                if spilled in self._disk_drop:  # dropped earlier this step: its new file must stay
                    self._disk_drop.remove(spilled)
                self._spill.append((pushed_out[1], spilled, pushed_out[2]))
                self._disk_drop.extend(self.disk.add(spilled, pushed_out[2]))
            if slot is not None:
                self._swap_out.append((b, slot))

    def match_host(self, token_ids: Sequence[int], prefix: MatchResult) -> list[int]:
        """The lower-tier blocks that continue ``prefix`` (the device match of ``token_ids``), each
        from the host tier if it holds it, else from the disk tier, as keys for ``allocate_slots``;
        never the block that holds the last token (it is computed)."""
        if self.host is None:
            return []
        bs = self.block_size
        prev = self.radix.hash_of(prefix.block_ids[-1]) if prefix.block_ids else 0
        keys = []
        for i in range(len(prefix.block_ids), (len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            prev = block_hash(prev, tokens)
            if self.host.lookup(prev, tokens) is None and (self.disk is None or not self.disk.lookup(prev, tokens)):
                break
            keys.append(prev)
        return keys

    def disk_keys(self, keys: Sequence[int]) -> list[int]:
        """Those of ``match_host``'s keys that ``allocate_slots`` would read from files (the host
        tier does not hold them)."""
        return [k for k in keys if self.host.lookup_key(k) is None]

    def spilling(self) -> set[int]:
        """The keys that go to files in the step being scheduled (their copies are not taken yet)."""
        return {k for _, k, _ in self._spill}

    def begin_step(self) -> None:
        """A new schedule: the copies handed to the runner last step have run."""
        if self.host is not None:
            self.host.release_delivered()

    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(swap-outs, swap-ins) for the runner, since the last call."""
        out, inn = self._swap_out, self._swap_in
        self._swap_out, self._swap_in = [], []
        if self.host is not None:
            self.host.deliver()
        return out, inn

    def take_disk_ops(self) -> tuple[list, list, list]:
        """(spills (host slot, key, tokens), loads (key, device block), dropped keys) since the
        last call; the runner spills first, loads after the swap-ins, drops last."""
        ops = self._spill, self._load, self._disk_drop
        self._spill, self._load, self._disk_drop = [], [], []
        return ops

    def reset_cache(self, spilled_keys: Sequence[int] = ()) -> None:
        """Drop every unlocked cached block, on the device and in the host tier (after a failed
        step: their KV can no longer be trusted), and from the disk tier's index the blocks that
        step was to write (``spilled_keys``: their files may be missing or stale)."""
        self.radix.reset()
        if self.host is not None:
            self.host.clear()
        self._swap_out, self._swap_in = [], []
        if self.disk is not None:
            for key in spilled_keys:
                self.disk.remove(key)
        self._spill, self._load = [], []

    def blocks_missing_on_disk(self):
        """(key, tokens, "device" | "host", block id or host slot) of every cached block the disk
        tier lacks: what a clean shutdown writes (``LLMEngine.flush_kv_cache``)."""
        bs = self.block_size
        for node in self.radix._nodes():
            for i, (b, key) in enumerate(zip(node.block_ids, node.hashes)):
                if key not in self.disk:
                    yield key, tuple(node.tokens[i * bs:(i + 1) * bs]), "device", b
        for key, slot, tokens in self.host.entries():
            if key not in self.disk:
                yield key, tokens, "host", slot

    def _mark(self, seq_id: str, index: int) -> None:
        d = self._dirty.get(seq_id)
        if d is None or index < d:
            self._dirty[seq_id] = index

    def take_table_deltas(self, seq_ids: list[str]) -> list[tuple[int, list[int]] | None]:
        """What changed in each of these tables since it was last taken: (first changed index, the
        block ids from there to the end: the table's new length is their sum), or None if nothing did."""
        pop, tables = self._dirty.pop, self.block_tables
        out = []
        if self.num_groups > 1:  # (first changed index, the anchor's ids, the other groups' ids)
            extra = self.extra_tables
            for sid in seq_ids:
                d = pop(sid, None)
                out.append(None if d is None else (d, tables[sid][d:], tuple(t[d:] for t in extra[sid])))
            return out
        for sid in seq_ids:
            d = pop(sid, None)
            out.append(None if d is None else (d, tables[sid][d:]))
        return out

    def take_released(self) -> list[str]:
        """The seq_ids whose tables were dropped since the last call."""
        out, self._released = self._released, []
        return out

    def cache_blocks(self, seq_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Insert the newly completed full blocks of a request into the tree."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = num_computed // bs
        done = self.num_indexed_blocks[seq_id]
        if num_full <= done:
            return
        table = self.block_tables[seq_id]
        if self.grouped:
            if seq_id not in self._stopped:
                self.radix.insert(token_ids, table, num_done=done, num_blocks=num_full,
                                  extra=self.extra_tables[seq_id])
                if not self.pool.cached[table[num_full - 1]]:  # (in the window: not NULL)
                    self._stopped.add(seq_id)
            self.num_indexed_blocks[seq_id] = num_full
            return
        # a path that stopped at a duplicate block (see RadixIndex.insert) stays stopped: the
        # block before the new ones is then not the tree's
        if not done or self.pool.cached[table[done - 1]]:
            self.radix.insert(token_ids, table, num_done=done, num_blocks=num_full)
        self.num_indexed_blocks[seq_id] = num_full

    def extend(self, seq_id: str, num_tokens: int, reserve: int = 0) -> bool:
        """Append free blocks (never evicting, leaving ``reserve`` free) until the table covers
        ``num_tokens``; for a speculative draft after the step's own allocation (which did any
        copy-on-write). False, and nothing changed, if the free blocks do not suffice."""
        table = self.block_tables[seq_id]
        need = -(-num_tokens // self.block_size) - len(table)
        if need * self.num_groups + reserve > self.pool.num_free:
            return False
        if need > 0:
            self._mark(seq_id, len(table))
        tables = self._tables(seq_id)
        for _ in range(need):
            for t in tables:
                t.append(self.pool.allocate())
        return True

    def trim(self, seq_id: str, num_tokens: int) -> None:
        """Free the blocks past the first ``num_tokens`` tokens (a rejected speculative draft's):
        they hold nothing verified, so they are in no tree and shared with nobody."""
        table = self.block_tables[seq_id]
        keep = -(-num_tokens // self.block_size)
        if len(table) > keep:
            self._mark(seq_id, keep)
        for t in self._tables(seq_id):
            while len(t) > keep:
                b = t.pop()
                assert self.pool.ref_cnt[b] == 1 and not self.pool.cached[b], (seq_id, b)
                self.pool.decref(b)

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent (including the partial last block)."""
        table = self.block_tables[parent_id]
        if self.grouped:
            NULL = self.NULL
            for t in self._tables(parent_id):
                for b in t:
                    if b != NULL:
                        self.pool.incref(b)
            self.extra_tables[child_id] = tuple(list(t) for t in self.extra_tables[parent_id])
            self._win_start[child_id] = list(self._win_start[parent_id])
            if parent_id in self._stopped:
                self._stopped.add(child_id)
        else:
            for b in table:
                self.pool.incref(b)
        self.block_tables[child_id] = list(table)
        self.num_indexed_blocks[child_id] = self.num_indexed_blocks[parent_id]
        self._dirty[child_id] = 0

    def free(self, seq_id: str) -> None:
        """Drop a request's table. Its cached blocks stay in the tree (evictable); the rest go back
        to the free list, tail first."""
        if seq_id in self.block_tables:
            self._release(seq_id)

    def _release(self, seq_id: str, report: bool = True) -> None:
        table = self.block_tables.pop(seq_id)
        self.num_indexed_blocks.pop(seq_id)
        self._dirty.pop(seq_id, None)
        if report:
            self._released.append(seq_id)
        if self.grouped:
            NULL = self.NULL
            self._win_start.pop(seq_id)
            self._stopped.discard(seq_id)
            for g, t in enumerate((table, *self.extra_tables.pop(seq_id))):
                if self.windows[g] is None:
                    for b in reversed(t):
                        self.pool.decref(b)
                    continue
                for b in t:  # earliest first: the tree's copies then go before the window's end
                    if b != NULL:
                        self._drop(b)
            return
        for b in reversed(table):
            self.pool.decref(b)

    def record_query(self, num_queried: int, num_hit: int, num_host_hit: int = 0) -> None:
        """``num_hit`` counts every cached token found, ``num_host_hit`` those the host tier gave."""
        self.num_queried_tokens += num_queried
        self.num_hit_tokens += num_hit
        self.num_host_hit_tokens += num_host_hit

    def cache_digest(self) -> dict[int, int]:
        """block hash -> tier (``TIER_DEVICE``, ``TIER_HOST``, ``TIER_DISK``; the highest one that
        holds it) of every cached full block: which prefixes this engine can serve from cache, for
        a router (serve/router.py matches a request's block hashes against it)."""
        out: dict[int, int] = {}
        if self.disk is not None:
            out.update(dict.fromkeys(self.disk.keys(), TIER_DISK))
        if self.host is not None:
            out.update(dict.fromkeys(self.host.keys(), TIER_HOST))
        out.update(dict.fromkeys(self.radix.block_hashes(), TIER_DEVICE))
        return out

    def check_integrity(self) -> None:
        """free + evictable + in use == total; every ref count equals its holders."""
        self.pool.check_integrity()
        self.radix.check_integrity()
        if self.host is not None:
            self.host.check_integrity()
        holders = [1 if c else 0 for c in self.pool.cached]
        NULL = self.NULL
        for seq_id, table in self.block_tables.items():
            tables = self._tables(seq_id)
            assert all(len(t) == len(table) for t in tables), f"{seq_id}: group tables of different lengths"
            pages = [b for t in tables for b in t if b != NULL]
            assert len(set(pages)) == len(pages), f"{seq_id} holds a block twice: {tables}"
            for g, w in self.windowed:  # nothing before a window is held; everything after it is
                start = self._win_start[seq_id][g]
                t = tables[g]
                assert all(b == NULL for b in t[:start]), f"{seq_id} holds group {g}'s pages before its window"
                assert NULL not in t[start:], f"{seq_id} lacks a page of group {g} inside its window: {t}"
            for b in pages:
                holders[b] += 1
        bad = {b: (self.pool.ref_cnt[b], h) for b, h in enumerate(holders) if self.pool.ref_cnt[b] != h}
        assert not bad, f"ref_cnt != holders for blocks {{id: (ref_cnt, holders)}} {bad}"
