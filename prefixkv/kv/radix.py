"""Radix tree over block-aligned token runs -> KV block ids. No torch.

Every edge holds a run of whole blocks: ``len(node.tokens) == len(node.block_ids) * block_size``.
Children are keyed by the tokens of their first block, so siblings differ in their first block.
The tree is one of a block's holders: ``insert`` pins the blocks it adopts (ref_cnt + 1) and
``evict`` unpins them. A request "locks" the blocks it uses by holding them in its block table
(ref_cnt > 1), so a block is evictable exactly when ``ref_cnt == 1``.

Invariant kept by ``insert``: the blocks a request holds that the tree also holds form a path
from the root. So an unlocked interior block has only unlocked descendants, and evicting
leaves first can reclaim every evictable block.
"""

from __future__ import annotations

import heapq
import itertools
from typing import NamedTuple, Sequence

from prefixkv.kv.block_pool import BlockPool


class MatchResult(NamedTuple):
    block_ids: list[int]
    num_tokens: int


class RadixNode:
    __slots__ = ("tokens", "block_ids", "children", "parent", "last_access")

    def __init__(self, tokens: tuple[int, ...], block_ids: list[int], parent: "RadixNode | None") -> None:
        self.tokens = tokens
        self.block_ids = block_ids
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.parent = parent
        self.last_access = 0


class RadixIndex:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.root = RadixNode((), [], None)
        self._clock = itertools.count(1)
        self.num_cached_blocks = 0

    def _key(self, tokens: Sequence[int], pos: int) -> tuple[int, ...]:
        return tuple(tokens[pos:pos + self.block_size])

    def _walk(self, tokens: Sequence[int]):
        """Yield (node, num_matched_blocks_in_node, pos_before_node) along the longest match."""
        bs = self.block_size
        node, pos = self.root, 0
        while pos + bs <= len(tokens):
            child = node.children.get(self._key(tokens, pos))
            if child is None:
                return
            m = 1
            n_child = len(child.block_ids)
            while m < n_child and pos + (m + 1) * bs <= len(tokens) and \
                    child.tokens[m * bs:(m + 1) * bs] == tuple(tokens[pos + m * bs:pos + (m + 1) * bs]):
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
        now = next(self._clock) if touch else 0
        for node, m, _ in self._walk(tokens):
            if touch:
                node.last_access = now
            block_ids.extend(node.block_ids[:m])
        return MatchResult(block_ids, len(block_ids) * self.block_size)

    def insert(self, tokens: Sequence[int], block_ids: Sequence[int]) -> int:
        """Cache ``block_ids`` as holding ``tokens`` (``len(tokens) == len(block_ids) * block_size``).

        Walks the existing path; where the tree already holds a block for the same tokens it
        keeps its own. If the tree's block differs from the caller's at some position, the caller
        holds a duplicate and insertion stops there (its later blocks would hang under blocks it
        does not hold). New blocks are pinned. Returns the number of blocks newly cached.
        """
        bs = self.block_size
        assert len(tokens) == len(block_ids) * bs, (len(tokens), len(block_ids), bs)
        now = next(self._clock)
        node, pos = self.root, 0
        for child, m, p in self._walk(tokens):
            child.last_access = now
            i0 = p // bs
            if child.block_ids[:m] != list(block_ids[i0:i0 + m]):
                return 0
            if m < len(child.block_ids):
                if p + m * bs >= len(tokens):
                    return 0  # everything given is already cached
                child = self._split(child, m)
            node, pos = child, p + m * bs
        if pos >= len(tokens):
            return 0
        new_blocks = list(block_ids[pos // bs:])
        leaf = RadixNode(tuple(tokens[pos:]), new_blocks, node)
        leaf.last_access = now
        node.children[self._key(tokens, pos)] = leaf
        for b in new_blocks:
            self.pool.pin(b)
        self.num_cached_blocks += len(new_blocks)
        return len(new_blocks)

    def _split(self, node: RadixNode, m: int) -> RadixNode:
        """Split ``node`` after its first ``m`` blocks; return the new upper node."""
        bs = self.block_size
        upper = RadixNode(node.tokens[:m * bs], node.block_ids[:m], node.parent)
        upper.last_access = node.last_access
        assert node.parent is not None
        node.parent.children[node.tokens[:bs]] = upper
        node.tokens, node.block_ids, node.parent = node.tokens[m * bs:], node.block_ids[m:], upper
        upper.children[node.tokens[:bs]] = node
        return upper

    def evict(self, num_blocks: int) -> list[int]:
        """Free up to ``num_blocks`` blocks that only the tree holds, least recently used leaves
        first, each leaf from its tail block up. Returns the freed block ids in eviction order."""
        heap = [(n.last_access, id(n), n) for n in self._nodes() if not n.children]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_blocks:
            _, _, node = heapq.heappop(heap)
            while node.block_ids and len(freed) < num_blocks and self.pool.ref_cnt[node.block_ids[-1]] == 1:
                b = node.block_ids.pop()
                node.tokens = node.tokens[:-self.block_size]
                self.pool.unpin(b)
                freed.append(b)
            if node.block_ids:
                continue  # locked tail or enough freed
            parent = node.parent
            assert parent is not None
            del parent.children[next(k for k, c in parent.children.items() if c is node)]
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        self.num_cached_blocks -= len(freed)
        return freed

    def reset(self) -> int:
        """Drop every unlocked cached block (e.g. after weights change). Returns how many."""
        return len(self.evict(self.pool.num_blocks))

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def cached_blocks(self) -> dict[int, tuple[int, ...]]:
        """block id -> the tokens its KV holds, for every block in the tree."""
        out: dict[int, tuple[int, ...]] = {}
        bs = self.block_size
        for n in self._nodes():
            for i, b in enumerate(n.block_ids):
                out[b] = n.tokens[i * bs:(i + 1) * bs]
        return out

    def check_integrity(self) -> None:
        bs = self.block_size
        seen: set[int] = set()
        for n in self._nodes():
            assert n.block_ids, f"empty non-root node with tokens {n.tokens[:8]}"
            assert len(n.tokens) == len(n.block_ids) * bs, f"node tokens {len(n.tokens)} != {len(n.block_ids)} blocks"
            assert n.parent is not None and n.parent.children.get(n.tokens[:bs]) is n, "bad child key"
            for b in n.block_ids:
                assert b not in seen, f"block {b} twice in the tree"
                assert self.pool.cached[b], f"tree block {b} not marked cached"
                seen.add(b)
        cached = {b for b in range(self.pool.num_blocks) if self.pool.cached[b]}
        assert cached == seen, f"pool says cached {sorted(cached)}, tree holds {sorted(seen)}"
        assert self.num_cached_blocks == len(seen)
