"""Radix tree over block-aligned token runs -> KV block ids. No torch.

Every edge holds a run of whole blocks: ``len(node.tokens) == len(node.block_ids) * block_size``.
Children are keyed by the tokens of their first block, so siblings differ in their first block.
The tree is one of a block's holders: ``insert`` pins the blocks it adopts (ref_cnt + 1) and
``evict`` unpins them. A request "locks" the blocks it uses by holding them in its block table
(ref_cnt > 1), so a block is evictable exactly when ``ref_cnt == 1``.

Invariant kept by ``insert``: the blocks a request holds that the tree also holds form a path
from the root. So an unlocked interior block has only unlocked descendants, and evicting
leaves first can reclaim every evictable block.

KV cache groups (kv/groups.py): with more than one group a node keeps, beside ``block_ids`` (the
anchor group's pages), one page list per further group (``extra``). A windowed group's page may
be ``NULL`` (``pool.num_blocks``, the dummy page): freed once no request needed it. Windowed pages
become evictable one by one, not only from a leaf's tail: each one the last request lets go of
(``note_released``) joins a heap by release time, and ``evict`` takes from it or from the leaves,
whichever waited longer (one LRU clock). A page inside the window of its node's end (what a hit
ending there needs: a shared prefix's end, a conversation's last turn) waits as long as its node
and its newest children: popped while they were used since, it goes back under their time. A
match stops where a windowed group lacks a page its window needs: a prefix of P tokens is usable
when every full group has all its pages and each windowed group those of the blocks that
``[P - window + 1, P)`` touches (the next query, at P, sees keys from P - window + 1 on).
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from typing import NamedTuple, Sequence

from prefixkv.kv.block_pool import BlockPool
from prefixkv.kv.hashing import block_hash


class MatchResult(NamedTuple):
    block_ids: list[int]
    num_tokens: int
    # with KV cache groups: the pages of the groups after the anchor, one list per group, each as
    # long as ``block_ids`` (``NULL`` before a windowed group's window)
    extra: tuple[list[int], ...] = ()


SUMMARY_CANDIDATES = 128  # children of a shown node that RadixIndex.summary ranks


class RadixNode:
    __slots__ = ("tokens", "block_ids", "hashes", "children", "parent", "last_access", "key", "extra", "start")

    def __init__(self, tokens: array, block_ids: list[int], parent: "RadixNode | None",
                 key: tuple[int, ...] = (), hashes: array | None = None,
                 extra: tuple[list[int], ...] = ()) -> None:
        # an int64 array (the garbage collector does not walk it): a growing leaf extends it and
        # eviction trims it in place
        self.tokens = tokens
        self.block_ids = block_ids
        self.hashes = hashes if hashes is not None else array("q")  # block_hash of each block
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.parent = parent  # None for the root and for a node removed from the tree
        self.last_access = 0
        self.key = key  # the tokens of its first block: its key in parent.children
        self.extra = extra  # per group after the anchor: its pages, parallel to block_ids
        self.start = 0  # index of its first block in the sequence (blocks of its ancestors)


class RadixIndex:
    """Costs that stay flat as the cache grows (counted in ``num_visits``, see the tests):

    * ``match`` and ``insert`` visit the nodes along one path; ``insert(..., num_done=k)`` starts
      after the caller's first k blocks (found through ``block -> node``), so a request caching
      one more block costs O(1), not a walk from the root; a leaf that grows is extended in place.
    * ``evict`` pops leaves from a heap ordered by last access (lazy: a touched or changed leaf
      is pushed again and stale entries are skipped; the heap is rebuilt when stale entries
      outnumber the nodes), so freeing k blocks costs O((k + stale) log n), not a scan of the tree.
    """

    def __init__(self, pool: BlockPool, block_size: int, windows: tuple[int | None, ...] = (None,)) -> None:
        self.pool = pool
        self.block_size = block_size
        self.windows = windows  # per KV cache group (kv/groups.py): its window or None
        self.num_extra = len(windows) - 1
        self.NULL = pool.num_blocks  # a windowed group's missing page
        # groups whose pages are freed out of the window, and their windows
        self._windowed = [(g, w) for g, w in enumerate(windows) if w is not None]
        self.anchor_windowed = windows[0] is not None
        self.root = RadixNode(array("q"), [], None, extra=tuple([] for _ in range(self.num_extra)))
        self.clock = 0  # LRU time: one tick per match or insert that touches
        self._seq = itertools.count()
        self.num_cached_blocks = 0
        self.num_nodes = 0
        self.num_visits = 0  # nodes visited by match / insert / evict (complexity tests)
        self.version = 0  # bumped whenever blocks enter or leave the tree: equal versions, equal matches
        self._block_node: dict[int, RadixNode] = {}
        self._leaf_heap: list[tuple[int, int, RadixNode]] = []
        # windowed groups: page -> (node, group) for the groups after the anchor (the anchor's are
        # in _block_node), and the released windowed pages by release time (a heap; an entry is
        # live while _release_time holds its time for its page)
        self._page_node: dict[int, tuple[RadixNode, int]] = {}
        self._released: list[tuple[int, int, int]] = []  # heap of (time, seq, page)
        self._release_time: dict[int, int] = {}

    def _key(self, tokens: Sequence[int], pos: int) -> tuple[int, ...]:
        return tuple(tokens[pos:pos + self.block_size])

    def _push_leaf(self, node: RadixNode) -> None:
        heapq.heappush(self._leaf_heap, (node.last_access, next(self._seq), node))
        if len(self._leaf_heap) > 2 * self.num_nodes + 64:  # mostly stale: rebuild from live leaves
            self._leaf_heap = [(n.last_access, next(self._seq), n) for n in self._nodes() if not n.children]
            heapq.heapify(self._leaf_heap)

    def _touch(self, node: RadixNode, now: int) -> None:
        node.last_access = now
        if not node.children:
            self._push_leaf(node)

    def _walk(self, tokens: Sequence[int], end: int, node: RadixNode | None = None, pos: int = 0):
        """Yield (node, num_matched_blocks_in_node, pos_before_node) along the longest match of
        ``tokens[pos:end]`` below ``node`` (the root by default)."""
        bs = self.block_size
        node = node or self.root
        while pos + bs <= end:
            child = node.children.get(self._key(tokens, pos))
            self.num_visits += 1
            if child is None:
                return
            m = 1
            n_child = len(child.block_ids)
            while m < n_child and pos + (m + 1) * bs <= end and \
                    tuple(child.tokens[m * bs:(m + 1) * bs]) == tuple(tokens[pos + m * bs:pos + (m + 1) * bs]):
                m += 1
            yield child, m, pos
            if m < n_child:
                return
            node, pos = child, pos + m * bs

    def match(self, tokens: Sequence[int], touch: bool = True) -> MatchResult:
        """Longest cached prefix of ``tokens`` in whole blocks.

        Touches the matched nodes (LRU) unless ``touch`` is False. Takes no references: the caller
        must incref the returned blocks before anything may evict (any later allocation can).
        """
        block_ids: list[int] = []
        extra = tuple([] for _ in range(self.num_extra))
        now = 0
        if touch:
            self.clock = now = self.clock + 1
        for node, m, _ in self._walk(tokens, len(tokens)):
            if touch:
                self._touch(node, now)  # pushes only a leaf: the last node of the path, if any
            block_ids.extend(node.block_ids[:m])
            for mine, theirs in zip(extra, node.extra):
                mine.extend(theirs[:m])
        if not self._windowed:
            return MatchResult(block_ids, len(block_ids) * self.block_size, extra)
        return self._window_usable(block_ids, extra)

    def window_start(self, window: int, num_computed: int) -> int:
        """First block a windowed group still needs once ``num_computed`` tokens are computed: the
        next query, at position ``num_computed``, sees keys from ``num_computed - window + 1`` on."""
        return max(0, num_computed - window + 1) // self.block_size

    def _window_usable(self, block_ids: list[int], extra: tuple[list[int], ...]) -> MatchResult:
        """The longest prefix of a match that every windowed group can serve (see the module
        docstring), with the pages before each window left out (``NULL``): a request does not hold them."""
        NULL, bs = self.NULL, self.block_size
        groups = [block_ids, *extra]
        n = len(block_ids)
        while n:  # the window of a hit ending at n blocks: [window_start, n) in each windowed group
            last_null = -1
            for g, w in self._windowed:
                pages = groups[g]
                for i in range(n - 1, self.window_start(w, n * bs) - 1, -1):
                    if pages[i] == NULL:
                        last_null = max(last_null, i)
                        break
            if last_null < 0:
                break
            n = last_null  # every end in (last_null, n] has block last_null inside its window
        groups = [pages[:n] for pages in groups]
        for g, w in self._windowed:
            start = self.window_start(w, n * bs)
            groups[g][:start] = [NULL] * start
        return MatchResult(groups[0], n * bs, tuple(groups[1:]))

    def hash_of(self, block_id: int) -> int:
        """block_hash of a block the tree holds (continues a match's chain into a lower tier)."""
        node = self._block_node[block_id]
        i = len(node.block_ids) - 1
        if node.block_ids[i] != block_id:
            i = node.block_ids.index(block_id)
        return node.hashes[i]

    def insert(self, tokens: Sequence[int], block_ids: Sequence[int], num_done: int = 0,
               num_blocks: int | None = None, extra: Sequence[Sequence[int]] = ()) -> int:
        """Cache the first ``num_blocks`` of ``block_ids`` (default: all; ``tokens`` holds at least
        ``num_blocks * block_size`` tokens) as holding those tokens.

        ``num_done``: the caller's first ``num_done`` blocks are already on the tree as its path
        (inserted or matched by it, and held by it, so not evictable): the walk starts after them.
        Walks the existing path; where the tree already holds a block for the same tokens it
        keeps its own. If the tree's block differs from the caller's at some position, the caller
        holds a duplicate and insertion stops there (its later blocks would hang under blocks it
        does not hold). New blocks are pinned. Returns the number of blocks newly cached.

        ``extra``: the caller's pages of the groups after the anchor (parallel to ``block_ids``;
        the new blocks' are pinned too). A ``NULL`` anchor page of the caller (a windowed anchor
        whose window passed it) matches whatever the tree holds there.
        """
        bs = self.block_size
        if num_blocks is None:
            num_blocks = len(block_ids)
            assert len(tokens) == num_blocks * bs, (len(tokens), len(block_ids), bs)
        end = num_blocks * bs
        self.clock = now = self.clock + 1
        node, pos = self.root, 0
        if num_done:
            anchor = self._block_node.get(block_ids[num_done - 1])  # (none for NULL)
            if anchor is not None:
                i = len(anchor.block_ids) - 1
                if anchor.block_ids[i] != block_ids[num_done - 1]:  # the path ends inside this node
                    i = anchor.block_ids.index(block_ids[num_done - 1])
                    anchor = self._split(anchor, i + 1)
                node, pos = anchor, num_done * bs
        # only the last node a walk visits can be a leaf: it is touched (pushed) on every way out
        for child, m, p in self._walk(tokens, end, node, pos):
            i0 = p // bs
            if child.block_ids[:m] != list(block_ids[i0:i0 + m]) and not self._same_path(child, m, block_ids, i0):
                self._touch(child, now)
                return 0
            if m < len(child.block_ids):
                if p + m * bs >= end:
                    self._touch(child, now)
                    return 0  # everything given is already cached
                child = self._split(child, m)
            child.last_access = now
            node, pos = child, p + m * bs
        if pos >= end:
            if node is not self.root:
                self._touch(node, now)
            return 0
        new_blocks = list(block_ids[pos // bs:num_blocks])
        new_extra = tuple(list(e[pos // bs:num_blocks]) for e in extra)
        prev = node.hashes[-1] if node.hashes else 0
        hashes = array("q")
        for p in range(pos, end, bs):
            prev = block_hash(prev, tokens[p:p + bs])
            hashes.append(prev)
        if node is not self.root and not node.children:  # a growing leaf: extend it in place
            node.tokens.extend(tokens[pos:end])
            node.block_ids.extend(new_blocks)
            node.hashes.extend(hashes)
            for mine, new in zip(node.extra, new_extra):
                mine.extend(new)
            leaf = node
        else:
            key = self._key(tokens, pos)
            leaf = RadixNode(array("q", tokens[pos:end]), new_blocks, node, key, hashes, new_extra)
            leaf.start = pos // bs
            node.children[key] = leaf
            self.num_nodes += 1
        NULL, pinned = self.NULL, 0
        for b in new_blocks:
            if b != NULL:
                self.pool.pin(b)
                self._block_node[b] = leaf
                pinned += 1
        for g, pages in enumerate(new_extra, start=1):
            for b in pages:
                if b != NULL:
                    self.pool.pin(b)
                    self._page_node[b] = (leaf, g)
                    pinned += 1
        self._touch(leaf, now)
        self.num_cached_blocks += pinned
        self.version += 1
        return len(new_blocks)

    def _same_path(self, node: RadixNode, m: int, block_ids: Sequence[int], i0: int) -> bool:
        """Whether the caller's anchor pages equal the node's first ``m``, where the caller's are
        not NULL (a windowed anchor's caller no longer holds the pages before its window)."""
        if not self.anchor_windowed:
            return False
        NULL = self.NULL
        return all(c == NULL or c == t for c, t in zip(block_ids[i0:i0 + m], node.block_ids[:m]))

    def note_released(self, page: int) -> None:
        """A windowed group's page that only the tree holds now: evictable on its own, after the
        pages released before it."""
        self._release_time[page] = self.clock
        heapq.heappush(self._released, (self.clock, next(self._seq), page))

    def _split(self, node: RadixNode, m: int) -> RadixNode:
        """Split ``node`` after its first ``m`` blocks; return the new upper node (the lower one
        keeps its identity, so a leaf stays a leaf)."""
        bs = self.block_size
        assert node.parent is not None
        upper = RadixNode(node.tokens[:m * bs], node.block_ids[:m], node.parent, node.key, node.hashes[:m],
                          tuple(e[:m] for e in node.extra))
        upper.last_access = node.last_access
        upper.start = node.start
        node.start += m
        node.parent.children[node.key] = upper
        node.tokens, node.block_ids, node.parent = node.tokens[m * bs:], node.block_ids[m:], upper
        node.hashes = node.hashes[m:]
        node.extra = tuple(e[m:] for e in node.extra)
        node.key = tuple(node.tokens[:bs])
        upper.children[node.key] = node
        NULL = self.NULL
        for b in upper.block_ids:
            if b != NULL:
                self._block_node[b] = upper
        for g, pages in enumerate(upper.extra, start=1):
            for b in pages:
                if b != NULL:
                    self._page_node[b] = (upper, g)
        self.num_nodes += 1
        return upper

    def evict(self, num_blocks: int) -> list[int]:
        """Free up to ``num_blocks`` blocks that only the tree holds, least recently used leaves
        first, each leaf from its tail block up. Returns the freed block ids in eviction order.
        A leaf whose tail is locked (a request holds it) is set aside and pushed back after."""
        return [b for b, _, _ in self.evict_with_keys(num_blocks)]

    def evict_with_keys(self, num_blocks: int) -> list[tuple[int, int, tuple[int, ...]]]:
        """``evict``, returning (block id, its block_hash, its tokens) per freed block (what a lower
        cache tier keys its copy by). With windowed groups, released windowed pages and leaves
        go in one LRU order (the released page first on a tie), and a leaf's block goes with every
        page it has: up to ``num_groups - 1`` pages more than asked."""
        freed: list[tuple[int, int, tuple[int, ...]]] = []
        bs, NULL = self.block_size, self.NULL
        parked: list[RadixNode] = []
        heap, ref_cnt = self._leaf_heap, self.pool.ref_cnt
        released = self._released
        grouped = bool(self.num_extra or self._windowed)
        while len(freed) < num_blocks:
            if released:
                t, _, page = released[0]
                if self._release_time.get(page) != t or ref_cnt[page] != 1 or not self.pool.cached[page]:
                    heapq.heappop(released)  # taken by a request again, or evicted with its leaf
                    continue
                if not heap or t <= heap[0][0]:
                    heapq.heappop(released)
                    node_time = self._end_window_time(page)
                    if node_time > t:  # at its node's end, and the node was used since: wait with it
                        self._release_time[page] = node_time
                        heapq.heappush(released, (node_time, next(self._seq), page))
                        continue
                    self._evict_page(page, freed)
                    continue
            if not heap:
                break
            last_access, _, node = heapq.heappop(heap)
            self.num_visits += 1
            if node.parent is None or node.children or last_access != node.last_access:
                continue  # removed, no longer a leaf, or touched since (a newer entry exists)
            if grouped:
                self._evict_tail(node, num_blocks, freed)
            else:
                while node.block_ids and len(freed) < num_blocks and ref_cnt[node.block_ids[-1]] == 1:
                    b = node.block_ids.pop()
                    freed.append((b, node.hashes.pop(), tuple(node.tokens[-bs:])))
                    del node.tokens[-bs:]
                    self.pool.unpin(b)
                    del self._block_node[b]
            if node.block_ids:
                parked.append(node)  # locked tail, or enough freed: it stays a leaf
                continue
            parent = node.parent
            del parent.children[node.key]
            node.parent = None
            self.num_nodes -= 1
            if parent is not self.root and not parent.children:
                parent.last_access = max(parent.last_access, node.last_access)
                heapq.heappush(heap, (parent.last_access, next(self._seq), parent))
        for node in parked:
            heapq.heappush(heap, (node.last_access, next(self._seq), node))
        self.num_cached_blocks -= len(freed)
        if freed:
            self.version += 1
        if len(released) > 2 * len(self._release_time) + 64:  # mostly stale entries: keep the live ones
            self._released = [e for e in released if self._release_time.get(e[2]) == e[0]]
            heapq.heapify(self._released)
        return freed

    def _node_of(self, page: int) -> tuple[RadixNode, int, list[int]]:
        """(node, group, that group's page list in the node) of a windowed page the tree holds."""
        hit = self._page_node.get(page)
        if hit is None:  # a windowed anchor's page
            node = self._block_node[page]
            return node, 0, node.block_ids
        node, g = hit
        return node, g, node.extra[g - 1]

    def _end_window_time(self, page: int) -> int:
        """If the page lies inside its group's window of its node's end (a hit ending there needs
        it), the latest access of the node or of its newest children (an interior node outlives
        its children, as its full blocks do); else -1."""
        node, g, pages = self._node_of(page)
        end = node.start + len(node.block_ids)
        i = node.start + pages.index(page)
        if i < self.window_start(self.windows[g], end * self.block_size):
            return -1
        newest = itertools.islice(reversed(node.children.values()), 8)
        return max(node.last_access, max((c.last_access for c in newest), default=-1))

    def _evict_tail(self, node: RadixNode, num_blocks: int, freed: list) -> None:
        """Free a leaf's unlocked tail blocks (every group's page of each; NULL ones free nothing)."""
        bs, NULL, ref_cnt = self.block_size, self.NULL, self.pool.ref_cnt
        while node.block_ids and len(freed) < num_blocks:
            pages = [node.block_ids[-1], *(e[-1] for e in node.extra)]
            if any(b != NULL and ref_cnt[b] != 1 for b in pages):
                return  # locked: a request holds this block
            node.block_ids.pop()
            for e in node.extra:
                e.pop()
            h, toks = node.hashes.pop(), tuple(node.tokens[-bs:])
            del node.tokens[-bs:]
            for g, b in enumerate(pages):
                if b == NULL:
                    continue
                self.pool.unpin(b)
                if g:
                    del self._page_node[b]
                else:
                    del self._block_node[b]
                self._release_time.pop(b, None)
                freed.append((b, h, toks))

    def _evict_page(self, page: int, freed: list) -> None:
        """Free one released windowed page; the tree keeps the block (its page of that group NULL)."""
        node, g, pages = self._node_of(page)
        if g:
            del self._page_node[page]
        else:
            del self._block_node[page]
        i = pages.index(page)
        pages[i] = self.NULL
        del self._release_time[page]
        self.pool.unpin(page)
        bs = self.block_size
        freed.append((page, node.hashes[i], tuple(node.tokens[i * bs:(i + 1) * bs])))

    def reset(self) -> int:
        """Drop every unlocked cached block (e.g. after weights change). Returns how many."""
        return len(self.evict(self.pool.num_blocks))

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def summary(self, max_nodes: int = 64, max_children: int = 8, max_depth: int = 6,
                max_tokens: int = 0) -> dict:
        """The top of the tree as plain data, for a live view, bounded in size and in work however
        large the tree is: it visits at most ``SUMMARY_CANDIDATES`` children of each node it shows
        (the most recently created ones: a root with 10^5 distinct first blocks costs no more than
        one with 100), so at most ``(max_nodes + 1) * SUMMARY_CANDIDATES`` nodes.

        Each node: ``num_tokens``/``num_blocks`` of its own run, ``num_requests`` holding its first
        block (``ref_cnt`` less the tree's own reference), ``age`` (index operations since it was
        last matched or inserted; 0 = just now), ``num_children`` (exact) and ``children`` (of
        those visited, the longest runs, the most recent among equals; at most ``max_children``,
        none below ``max_depth``), and ``token_ids`` (its first ``max_tokens`` tokens) only when
        ``max_tokens`` > 0. Breadth first, so the top levels are kept when ``max_nodes`` cuts."""
        bs = self.block_size
        now = self.clock
        root = {"num_children": len(self.root.children), "children": []}
        queue = [(self.root, root, 0)]
        shown = 0
        for node, out, depth in queue:  # grows while it is walked: breadth first
            if depth >= max_depth or not node.children:
                continue
            room = min(max_children, max_nodes - shown)
            if room <= 0:
                break
            candidates = itertools.islice(reversed(node.children.values()), SUMMARY_CANDIDATES)
            ranked = heapq.nlargest(room, candidates, key=lambda c: (len(c.block_ids), c.last_access))
            self.num_visits += min(len(node.children), SUMMARY_CANDIDATES)
            for child in ranked:
                entry = {"num_tokens": len(child.block_ids) * bs, "num_blocks": len(child.block_ids),
                         "num_requests": (self.pool.ref_cnt[child.block_ids[0]] - 1
                                          if child.block_ids[0] != self.NULL else 0),
                         "age": now - child.last_access, "num_children": len(child.children), "children": []}
                if max_tokens > 0:
                    entry["token_ids"] = child.tokens[:max_tokens].tolist()
                out["children"].append(entry)
                queue.append((child, entry, depth + 1))
            shown += len(ranked)
        return {"num_nodes": self.num_nodes, "num_cached_blocks": self.num_cached_blocks,
                "num_shown_nodes": shown, "root": root}

    def block_hashes(self):
        """The chain hash (``block_hash``) of every block in the tree (whose anchor page it holds)."""
        NULL = self.NULL
        for n in self._nodes():
            if self.anchor_windowed:
                yield from (h for h, b in zip(n.hashes, n.block_ids) if b != NULL)
            else:
                yield from n.hashes

    def cached_blocks(self) -> dict[int, tuple[int, ...]]:
        """block id -> the tokens its KV holds, for every block in the tree."""
        out: dict[int, tuple[int, ...]] = {}
        bs = self.block_size
        for n in self._nodes():
            for pages in (n.block_ids, *n.extra):
                for i, b in enumerate(pages):
                    if b != self.NULL:
                        out[b] = tuple(n.tokens[i * bs:(i + 1) * bs])
        return out

    def check_integrity(self) -> None:
        bs, NULL = self.block_size, self.NULL
        seen: set[int] = set()
        num_nodes = 0
        live = {(id(e[2]), e[0]) for e in self._leaf_heap}
        queued = {(t, b) for t, _, b in self._released}
        for n in self._nodes():
            num_nodes += 1
            assert n.block_ids, f"empty non-root node with tokens {n.tokens[:8]}"
            assert len(n.tokens) == len(n.block_ids) * bs, f"node tokens {len(n.tokens)} != {len(n.block_ids)} blocks"
            assert n.key == tuple(n.tokens[:bs]), f"node key {n.key} != its first block {n.tokens[:bs]}"
            prev = n.parent.hashes[-1] if n.parent.hashes else 0
            for i, h in enumerate(n.hashes):
                prev = block_hash(prev, n.tokens[i * bs:(i + 1) * bs])
                assert h == prev, f"node {n.tokens[:8]}: block {i}'s hash is stale"
            assert len(n.hashes) == len(n.block_ids), "a hash per block"
            assert len(n.extra) == self.num_extra and all(len(e) == len(n.block_ids) for e in n.extra), \
                "a page per block in every group"
            assert n.parent is not None and n.parent.children.get(n.key) is n, "bad child key"
            assert n.start == n.parent.start + len(n.parent.block_ids), f"node {n.tokens[:8]}: stale start"
            for g, pages in enumerate((n.block_ids, *n.extra)):
                assert NULL not in pages or self.windows[g] is not None, f"a full group's page is NULL: {pages}"
                for b in pages:
                    if b == NULL:
                        continue
                    assert b not in seen, f"block {b} twice in the tree"
                    assert self.pool.cached[b], f"tree block {b} not marked cached"
                    if g:
                        assert self._page_node.get(b) == (n, g), f"page {b}: page -> node map is stale"
                    else:
                        assert self._block_node.get(b) is n, f"block {b}: block -> node map is stale"
                    if self.windows[g] is not None and self.pool.ref_cnt[b] == 1:
                        t = self._release_time.get(b)
                        assert t is not None and (t, b) in queued, \
                            f"released windowed page {b} is not in the eviction queue"
                    seen.add(b)
            if not n.children:  # every leaf has a live heap entry (else evict could not find it)
                assert (id(n), n.last_access) in live, \
                    f"leaf {n.tokens[:8]} (last access {n.last_access}) has no heap entry"
        cached = {b for b in range(self.pool.num_blocks) if self.pool.cached[b]}
        assert cached == seen, f"pool says cached {sorted(cached)}, tree holds {sorted(seen)}"
        assert set(self._block_node) | set(self._page_node) == seen, "page -> node maps hold pages the tree does not"
        assert self.num_cached_blocks == len(seen)
        assert self.num_nodes == num_nodes, (self.num_nodes, num_nodes)
