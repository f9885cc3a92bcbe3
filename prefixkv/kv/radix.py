"""Radix tree over block-aligned token runs -> the pages of the full-attention KV cache groups. No torch.

Every edge holds a run of whole blocks: ``len(node.tokens) == node.num_blocks * block_size``. For
each block a node keeps its chain hash (kv/keys.py) and one page per group it indexes
(``pages[k]`` for ``group_ids[k]``; a model without sliding windows has one group, and a page is a
block of every layer). Children are keyed by the tokens of their first block, so siblings differ
in their first block. The tree is one of a page's holders: ``insert`` pins the pages it adopts
(ref_cnt + 1) and eviction unpins them. A request "locks" the blocks it uses by holding their
pages in its block tables (ref_cnt > 1), so a block is evictable exactly when ``ref_cnt == 1``.

Tenants: a request's chain starts from its ``root`` (kv/keys.py ``cache_root``: 0, or an int64 of
its cache salt and partition), and the root's children are keyed by ``(root, *first block)`` for a
non-zero root, so a match walks only the subtree of its own root: two roots share no node.

Invariant kept by ``insert``: the blocks a request holds that the tree also holds form a path
from the root. So an unlocked interior block has only unlocked descendants, and evicting leaves
first can reclaim every evictable block.

One eviction rule: the least recently used leaf goes first, from its tail block up; a block leaves
with all its pages. LRU time is the block pool's clock (``BlockPool.clock``), which every cache
over the pool stamps with, so that the coordinator can take the oldest of all of them.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from typing import Container, NamedTuple, Sequence

from prefixkv.kv.block_pool import BlockPool
from prefixkv.kv.hashing import block_hash
from prefixkv.kv.keys import EvictedPage, LowerPage

__all__ = ["MatchResult", "RadixIndex", "block_hash"]


class MatchResult(NamedTuple):
    """A prefix hit: ``num_tokens`` (whole blocks) and, per KV cache group, its table's first
    ``num_tokens // block_size`` entries (a cached page, or ``NULL`` where the request holds
    nothing: before a sliding window, or a page ``lower`` lists, which a lower tier supplies)."""

    blocks: tuple[list[int], ...]
    num_tokens: int
    lower: tuple[LowerPage, ...] = ()


SUMMARY_CANDIDATES = 128  # children of a shown node that RadixIndex.summary ranks


class RadixNode:
    __slots__ = ("tokens", "hashes", "pages", "children", "parent", "last_access", "key")

    def __init__(self, tokens: array, hashes: array, pages: tuple[list[int], ...], parent: "RadixNode | None",
                 key: tuple[int, ...] = ()) -> None:
        # int64 arrays (the garbage collector does not walk them): a growing leaf extends them and
        # eviction trims them in place
        self.tokens = tokens
        self.hashes = hashes  # the chain hash of each block
        self.pages = pages  # per indexed group: a page per block
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.parent = parent  # None for the root and for a node removed from the tree
        self.last_access = 0
        self.key = key  # the tokens of its first block: its key in parent.children

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)


class RadixIndex:
    """Costs that stay flat as the cache grows (counted in ``num_visits``, see the tests):

    * ``match`` and ``insert`` visit the nodes along one path; ``insert(..., num_done=k)`` starts
      after the caller's first k blocks (found through ``page -> node``), so a request caching
      one more block costs O(1), not a walk from the root; a leaf that grows is extended in place.
    * eviction pops leaves from a heap ordered by last access (lazy: a touched or changed leaf
      is pushed again and stale entries are skipped; the heap is rebuilt when stale entries
      outnumber the nodes), so freeing k blocks costs O((k + stale) log n), not a scan of the tree.
    """

    def __init__(self, pool: BlockPool, block_size: int, group_ids: tuple[int, ...] = (0,)) -> None:
        self.pool = pool
        self.block_size = block_size
        self.group_ids = group_ids  # the KV cache groups whose pages it keeps (full attention)
        self.root = RadixNode(array("q"), array("q"), tuple([] for _ in group_ids), None)
        self._seq = itertools.count()
        self.num_cached_blocks = 0  # pages the tree holds (blocks, with one group)
        self.num_nodes = 0
        self.num_visits = 0  # nodes visited by match / insert / evict (complexity tests)
        self.version = 0  # bumped whenever pages enter or leave the tree: equal versions, equal matches
        self._block_node: dict[int, RadixNode] = {}  # a block's first page -> its node
        self._leaf_heap: list[tuple[int, int, RadixNode]] = []
        self._parked: list[RadixNode] = []  # leaves with a locked tail, set aside by the running eviction

    @property
    def clock(self) -> int:
        return self.pool.clock

    def _tick(self) -> int:
        self.pool.clock += 1
        return self.pool.clock

    def _child_key(self, node: RadixNode, tokens: Sequence[int], pos: int, root: int) -> tuple[int, ...]:
        """The key of the child of ``node`` that holds the block at ``pos``: under the tree's root,
        prefixed with the chain's root unless it is 0 (a key of ``block_size + 1`` ints, which no
        unsalted key equals)."""
        key = tuple(tokens[pos:pos + self.block_size])
        return (root, *key) if root and node is self.root else key

    def _root_of(self, node: RadixNode) -> int:
        """The chain root of a child of the tree's root (its key's first int when prefixed)."""
        return node.key[0] if len(node.key) > self.block_size else 0

    def _push_leaf(self, node: RadixNode) -> None:
        heapq.heappush(self._leaf_heap, (node.last_access, next(self._seq), node))
        if len(self._leaf_heap) > 2 * self.num_nodes + 64:  # mostly stale: rebuild from live leaves
            self._leaf_heap = [(n.last_access, next(self._seq), n) for n in self._nodes() if not n.children]
            heapq.heapify(self._leaf_heap)

    def _touch(self, node: RadixNode, now: int) -> None:
        node.last_access = now
        if not node.children:
            self._push_leaf(node)

    def _walk(self, tokens: Sequence[int], end: int, node: RadixNode | None = None, pos: int = 0, root: int = 0):
        """Yield (node, num_matched_blocks_in_node, pos_before_node) along the longest match of
        ``tokens[pos:end]`` below ``node`` (the root by default) in the chain of ``root``."""
        bs = self.block_size
        node = node or self.root
        while pos + bs <= end:
            child = node.children.get(self._child_key(node, tokens, pos, root))
            self.num_visits += 1
            if child is None:
                return
            m = 1
            n_child = child.num_blocks
            while m < n_child and pos + (m + 1) * bs <= end and \
                    tuple(child.tokens[m * bs:(m + 1) * bs]) == tuple(tokens[pos + m * bs:pos + (m + 1) * bs]):
                m += 1
            yield child, m, pos
            if m < n_child:
                return
            node, pos = child, pos + m * bs

    def match(self, tokens: Sequence[int], touch: bool = True, num_tokens: int | None = None,
              root: int = 0) -> MatchResult:
        """Longest cached prefix of ``tokens[:num_tokens]`` (default: all) in whole blocks, in the
        chain of ``root`` (kv/keys.py ``cache_root``): its pages per indexed group.

        Touches the matched nodes (LRU) unless ``touch`` is False. Takes no references: the caller
        must incref the returned pages before anything may evict (any later allocation can).
        """
        pages = tuple([] for _ in self.group_ids)
        now = self._tick() if touch else 0
        for node, m, _ in self._walk(tokens, len(tokens) if num_tokens is None else num_tokens, root=root):
            if touch:
                self._touch(node, now)  # pushes only a leaf: the last node of the path, if any
            for mine, theirs in zip(pages, node.pages):
                mine.extend(theirs[:m])
        return MatchResult(pages, len(pages[0]) * self.block_size)

    def insert(self, tokens: Sequence[int], pages: Sequence[Sequence[int]], num_done: int = 0,
               num_blocks: int | None = None, hashes: Sequence[int] | None = None, root: int = 0) -> int:
        """Cache the first ``num_blocks`` blocks of ``pages`` (a page list per indexed group;
        default: all; ``tokens`` holds at least ``num_blocks * block_size`` tokens) as holding
        those tokens, in the chain of ``root``; ``hashes``, if given, are their chain hashes
        (computed from ``tokens`` and ``root`` else).

        ``num_done``: the caller's first ``num_done`` blocks are already on the tree as its path
        (inserted or matched by it, and held by it, so not evictable): the walk starts after them.
        Walks the existing path; where the tree already holds a block for the same tokens it
        keeps its own. If the tree's block differs from the caller's at some position, the caller
        holds a duplicate and insertion stops there (its later blocks would hang under blocks it
        does not hold). New pages are pinned. Returns the number of blocks newly cached.
        """
        bs = self.block_size
        first = pages[0]
        if num_blocks is None:
            num_blocks = len(first)
            assert len(tokens) == num_blocks * bs, (len(tokens), len(first), bs)
        end = num_blocks * bs
        now = self._tick()
        node, pos = self.root, 0
        if num_done:
            anchor = self._block_node.get(first[num_done - 1])
            if anchor is not None:
                i = anchor.num_blocks - 1
                if anchor.pages[0][i] != first[num_done - 1]:  # the path ends inside this node
                    i = anchor.pages[0].index(first[num_done - 1])
                    anchor = self._split(anchor, i + 1)
                node, pos = anchor, num_done * bs
        # only the last node a walk visits can be a leaf: it is touched (pushed) on every way out
        for child, m, p in self._walk(tokens, end, node, pos, root):
            i0 = p // bs
            if child.pages[0][:m] != list(first[i0:i0 + m]):
                self._touch(child, now)
                return 0
            if m < child.num_blocks:
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
        lo = pos // bs
        new_pages = tuple(list(g[lo:num_blocks]) for g in pages)
        if hashes is not None:
            new_hashes = array("q", hashes[lo:num_blocks])
        else:
            prev = node.hashes[-1] if node.hashes else root
            new_hashes = array("q")
            for p in range(pos, end, bs):
                prev = block_hash(prev, tokens[p:p + bs])
                new_hashes.append(prev)
        if node is not self.root and not node.children:  # a growing leaf: extend it in place
            node.tokens.extend(tokens[pos:end])
            node.hashes.extend(new_hashes)
            for mine, new in zip(node.pages, new_pages):
                mine.extend(new)
            leaf = node
        else:
            key = self._child_key(node, tokens, pos, root)
            leaf = RadixNode(array("q", tokens[pos:end]), new_hashes, new_pages, node, key)
            node.children[key] = leaf
            self.num_nodes += 1
        for g in new_pages:
            for b in g:
                self.pool.pin(b)
        for b in new_pages[0]:
            self._block_node[b] = leaf
        self._touch(leaf, now)
        self.num_cached_blocks += len(new_pages[0]) * len(new_pages)
        self.version += 1
        return len(new_pages[0])

    def _split(self, node: RadixNode, m: int) -> RadixNode:
        """Split ``node`` after its first ``m`` blocks; return the new upper node (the lower one
        keeps its identity, so a leaf stays a leaf)."""
        bs = self.block_size
        assert node.parent is not None
        upper = RadixNode(node.tokens[:m * bs], node.hashes[:m], tuple(g[:m] for g in node.pages), node.parent,
                          node.key)
        upper.last_access = node.last_access
        node.parent.children[node.key] = upper
        node.tokens, node.hashes, node.parent = node.tokens[m * bs:], node.hashes[m:], upper
        node.pages = tuple(g[m:] for g in node.pages)
        node.key = tuple(node.tokens[:bs])
        upper.children[node.key] = node
        for b in upper.pages[0]:
            self._block_node[b] = upper
        self.num_nodes += 1
        return upper

    # ------------------------------------------------------------------ eviction
    def evict(self, num_pages: int) -> list[int]:
        """Free up to ``num_pages`` pages that only the tree holds, least recently used leaves
        first, each leaf from its tail block up (a block with all its pages: up to
        ``len(group_ids) - 1`` more than asked). Returns the freed pages in eviction order."""
        return [e.page for e in self.evict_with_keys(num_pages)]

    def evict_with_keys(self, num_pages: int) -> list[EvictedPage]:
        """``evict``, returning each freed page with its key and its block's tokens (what a lower
        cache tier keys its copy by)."""
        freed: list[EvictedPage] = []
        while len(freed) < num_pages and self.eviction_head() is not None:
            freed += self.evict_next()
        self.end_eviction()
        return freed

    def eviction_head(self, retained: Container[int] | None = None) -> int | None:
        """The LRU time of the block ``evict_next`` takes, or None if no block is evictable.
        Leaves whose tail block is locked (a request holds it), or whose tail block's hash is in
        ``retained`` (kv/retention.py: then so are the node's other blocks), are set aside until
        ``end_eviction``, which every eviction pass ends with."""
        heap, ref_cnt = self._leaf_heap, self.pool.ref_cnt
        while heap:
            last_access, _, node = heap[0]
            if node.parent is None or node.children or last_access != node.last_access:
                heapq.heappop(heap)  # removed, no longer a leaf, or touched since (a newer entry exists)
                self.num_visits += 1
                continue
            if ref_cnt[node.pages[0][-1]] != 1 or (retained and node.hashes[-1] in retained):
                heapq.heappop(heap)
                self.num_visits += 1
                self._parked.append(node)
                continue
            return last_access
        return None

    def evict_next(self) -> list[EvictedPage]:
        """Free the tail block of the leaf ``eviction_head`` just reported: each of its pages."""
        node = self._leaf_heap[0][2]
        bs = self.block_size
        h = node.hashes.pop()
        tokens = tuple(node.tokens[-bs:])
        del node.tokens[-bs:]
        freed = []
        for g, pages in zip(self.group_ids, node.pages):
            page = pages.pop()
            self.pool.unpin(page)
            freed.append(EvictedPage(page, (h, g), tokens))
        del self._block_node[freed[0].page]
        self.num_cached_blocks -= len(freed)
        self.version += 1
        if not node.hashes:  # emptied: it leaves the tree, and its parent may become a leaf
            heapq.heappop(self._leaf_heap)
            self.num_visits += 1
            parent = node.parent
            del parent.children[node.key]
            node.parent = None
            self.num_nodes -= 1
            if parent is not self.root and not parent.children:
                parent.last_access = max(parent.last_access, node.last_access)
                heapq.heappush(self._leaf_heap, (parent.last_access, next(self._seq), parent))
        return freed

    def end_eviction(self) -> None:
        """Put back the leaves an eviction pass set aside."""
        for node in self._parked:
            heapq.heappush(self._leaf_heap, (node.last_access, next(self._seq), node))
        self._parked.clear()

    def reset(self) -> int:
        """Drop every unlocked cached page (e.g. after weights change). Returns how many."""
        return len(self.evict(self.pool.num_blocks))

    # ------------------------------------------------------------------ views
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
            ranked = heapq.nlargest(room, candidates, key=lambda c: (c.num_blocks, c.last_access))
            self.num_visits += min(len(node.children), SUMMARY_CANDIDATES)
            for child in ranked:
                entry = {"num_tokens": child.num_blocks * bs, "num_blocks": child.num_blocks,
                         "num_requests": self.pool.ref_cnt[child.pages[0][0]] - 1,
                         "age": now - child.last_access, "num_children": len(child.children), "children": []}
                if max_tokens > 0:
                    entry["token_ids"] = child.tokens[:max_tokens].tolist()
                out["children"].append(entry)
                queue.append((child, entry, depth + 1))
            shown += len(ranked)
        return {"num_nodes": self.num_nodes, "num_cached_blocks": self.num_cached_blocks,
                "num_shown_nodes": shown, "root": root}

    def block_hashes(self):
        """The chain hash of every block in the tree."""
        for n in self._nodes():
            yield from n.hashes

    def cached_pages(self):
        """(page, key, the tokens its KV holds) of every page in the tree."""
        bs = self.block_size
        for n in self._nodes():
            for i, h in enumerate(n.hashes):
                tokens = tuple(n.tokens[i * bs:(i + 1) * bs])
                for g, pages in zip(self.group_ids, n.pages):
                    yield pages[i], (h, g), tokens

    def check_integrity(self) -> None:
        bs = self.block_size
        seen: set[int] = set()
        num_nodes = 0
        live = {(id(e[2]), e[0]) for e in self._leaf_heap}
        for n in self._nodes():
            num_nodes += 1
            assert n.num_blocks, f"empty non-root node with tokens {n.tokens[:8]}"
            assert len(n.tokens) == n.num_blocks * bs, f"node tokens {len(n.tokens)} != {n.num_blocks} blocks"
            root = self._root_of(n) if n.parent is self.root else 0
            assert n.key[-bs:] == tuple(n.tokens[:bs]) and (len(n.key) == bs or root), \
                f"node key {n.key} != its first block {n.tokens[:bs]}"
            prev = n.parent.hashes[-1] if n.parent.hashes else root
            for i, h in enumerate(n.hashes):
                prev = block_hash(prev, n.tokens[i * bs:(i + 1) * bs])
                assert h == prev, f"node {n.tokens[:8]}: block {i}'s hash is stale"
            assert len(n.pages) == len(self.group_ids) and all(len(g) == n.num_blocks for g in n.pages), \
                "a page per block in every group"
            assert n.parent is not None and n.parent.children.get(n.key) is n, "bad child key"
            for g in n.pages:
                for b in g:
                    assert b not in seen, f"page {b} twice in the tree"
                    assert self.pool.cached[b], f"tree page {b} not marked cached"
                    seen.add(b)
            for i, b in enumerate(n.pages[0]):
                assert self._block_node.get(b) is n, f"page {b}: page -> node map is stale"
                rc = self.pool.ref_cnt[b]
                assert all(self.pool.ref_cnt[g[i]] == rc for g in n.pages), f"a block's pages held apart: {n.pages}"
            if not n.children:  # every leaf has a live heap entry (else eviction could not find it)
                assert (id(n), n.last_access) in live, \
                    f"leaf {n.tokens[:8]} (last access {n.last_access}) has no heap entry"
        assert set(self._block_node) <= seen, "page -> node map holds pages the tree does not"
        assert self.num_cached_blocks == len(seen), (self.num_cached_blocks, len(seen))
        assert self.num_nodes == num_nodes, (self.num_nodes, num_nodes)
        assert not self._parked, "an eviction pass did not end"
