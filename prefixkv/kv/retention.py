"""Retained prefixes: cached blocks that eviction spares until their TTL has passed. No torch.

A request may ask that its prompt's first ``num_tokens`` tokens stay cached for ``ttl_s`` seconds
since their last use (``SamplingParams.kv_retention_ttl_s`` / ``kv_retention_tokens``; Anthropic's
``cache_control``; a stored Responses conversation). What is retained is the prefix's full blocks,
named by their chain hashes (kv/keys.py), so a retention belongs to its request's ``cache_root``
(salt and partition): another tenant's equal tokens are other blocks.

* Eviction spares a retained block while anything else can go: the device pool's caches
  (kv/radix.py, the sliding-window map) and the host tier (kv/host_cache.py) set retained entries
  aside. When only retained blocks are left and a request needs pages, they go too (oldest first)
  and ``num_evicted`` counts them: retention never makes an admission fail, or a running request
  be preempted, that would have gone through without it. A retained block the device gives up is
  copied to the host tier like any other, where it is spared again.
* A hit that covers a whole retained prefix refreshes it (its TTL starts again).
* Bounded: the prefixes retained cover at most ``max_blocks`` distinct blocks
  (``CacheConfig.max_retained_fraction`` of the pool); a new one past that makes the least recently
  used retentions lapse first (``num_lapsed``), and one longer than the bound keeps its first
  ``max_blocks`` blocks. The bound counts the blocks asked for, cached yet or not.
* A prefix whose TTL has passed lapses (``num_expired``); its blocks are then ordinary cached
  blocks, evicted by recency.

Retentions are keyed by their last block's hash: asking again for the same prefix refreshes it (and
keeps the longer TTL). Time comes from ``clock`` (``time.monotonic`` unless a test injects one).

Releasing early: a retention asked under a ``handle`` (``SamplingParams.kv_retention_handle``; the
server names a stored Response's by the response's id) can be let go before its TTL with
``release(handle)``. A prefix is held by every handle that asked for it, and by the requests that
asked without one (``unnamed``: those lapse with the TTL only); it is dropped once the last handle
lets go and no request without one asked for it. Prefixes that share blocks stay independent: the
blocks a released prefix shares with another retained prefix stay retained (``blocks`` counts the
prefixes covering each), so releasing a conversation's first turn keeps what its continuation,
retained under its own handle, still covers. A handle names one prefix at a time (asking again
under it for another prefix moves it); once a prefix lapses or expires, its handles name nothing.

Blocks are the unit; the coordinator passes ``blocks`` (a hash -> count mapping, ``in`` is the
test) to the caches, each of which checks a block's hash when it would evict it. The retained set
is closed under prefixes (a retained block's parent is retained), so evicting leaves first never
has to take a retained parent to reach an unretained child.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence


class RetainedPrefix:
    __slots__ = ("hashes", "ttl_s", "last_use", "holders", "unnamed")

    def __init__(self, hashes: tuple[int, ...], ttl_s: float, last_use: float) -> None:
        self.hashes = hashes
        self.ttl_s = ttl_s
        self.last_use = last_use
        self.holders: set[str] = set()  # the handles it was asked under (``release`` lets go of one)
        self.unnamed = False  # asked for without a handle too: held until its TTL passes

    @property
    def deadline(self) -> float:
        return self.last_use + self.ttl_s


class RetentionTable:
    def __init__(self, max_blocks: int, clock: Callable[[], float] = time.monotonic) -> None:
        if max_blocks < 0:
            raise ValueError(f"max_blocks: must be >= 0, got {max_blocks}")
        self.max_blocks = max_blocks
        self.clock = clock
        self.blocks: dict[int, int] = {}  # block hash -> how many retained prefixes cover it
        # tail hash -> prefix, least recently used first
        self.prefixes: OrderedDict[int, RetainedPrefix] = OrderedDict()
        self.handles: dict[str, int] = {}  # handle -> the tail hash of the prefix it holds
        self._deadlines: list[tuple[float, int, int]] = []  # (deadline when pushed, seq, tail hash), lazy
        self._seq = itertools.count()
        self.num_lapsed = 0  # retentions dropped to keep the bound
        self.num_expired = 0  # retentions whose TTL passed
        self.num_evicted = 0  # retained pages evicted because a request needed the room

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.blocks

    def __bool__(self) -> bool:
        return bool(self.prefixes)

    @property
    def num_blocks(self) -> int:
        """Distinct blocks retained now (cached or not)."""
        return len(self.blocks)

    def retain(self, hashes: Sequence[int], ttl_s: float, handle: str | None = None) -> None:
        """Retain the prefix whose blocks have these chain hashes (its first ``max_blocks`` if
        longer) for ``ttl_s`` seconds since its last use; held by ``handle`` (``release``) or, with
        none, until the TTL passes."""
        hashes = tuple(hashes[:self.max_blocks])
        if not hashes:
            return
        now = self.clock()
        tail = hashes[-1]
        if handle is not None and self.handles.get(handle, tail) != tail:
            self.release(handle)  # the handle moves to this prefix
        p = self.prefixes.get(tail)
        if p is not None:
            p.ttl_s = max(p.ttl_s, ttl_s)
            p.last_use = now
            self.prefixes.move_to_end(tail)
        else:
            p = self.prefixes[tail] = RetainedPrefix(hashes, ttl_s, now)
            for h in hashes:
                self.blocks[h] = self.blocks.get(h, 0) + 1
            heapq.heappush(self._deadlines, (now + ttl_s, next(self._seq), tail))
        if handle is None:
            p.unnamed = True
        else:
            p.holders.add(handle)
            self.handles[handle] = tail
        while len(self.blocks) > self.max_blocks:  # the new one alone fits: it is never the oldest here
            self._drop(next(iter(self.prefixes)))
            self.num_lapsed += 1

    def touch(self, hashes: Sequence[int]) -> None:
        """A hit over the blocks with these hashes: every retained prefix it covers whole is used now."""
        prefixes = self.prefixes
        now = None
        for h in hashes:
            p = prefixes.get(h)
            if p is not None:
                now = self.clock() if now is None else now
                p.last_use = now
                prefixes.move_to_end(h)

    def expire(self) -> None:
        """Let go of every prefix whose TTL has passed since its last use."""
        heap = self._deadlines
        if not heap:
            return
        now = self.clock()
        while heap and heap[0][0] <= now:
            _, _, tail = heapq.heappop(heap)
            p = self.prefixes.get(tail)
            if p is None:
                continue  # lapsed or released before
            if p.deadline > now:  # used since it was pushed: its new deadline goes back in
                heapq.heappush(heap, (p.deadline, next(self._seq), tail))
                continue
            self._drop(tail)
            self.num_expired += 1
        if len(heap) > 2 * len(self.prefixes) + 64:  # mostly stale entries: rebuild
            self._deadlines = [(p.deadline, next(self._seq), t) for t, p in self.prefixes.items()]
            heapq.heapify(self._deadlines)

    def release(self, handle: str) -> bool:
        """``handle`` lets go of the prefix it holds; the prefix is dropped if nothing else holds
        it (another handle, or a request that asked without one). False if ``handle`` holds
        nothing (never used, released, or its prefix lapsed or expired)."""
        tail = self.handles.pop(handle, None)
        if tail is None:
            return False
        p = self.prefixes[tail]
        p.holders.discard(handle)
        if not p.holders and not p.unnamed:
            self._drop(tail)
        return True

    def _drop(self, tail: int) -> None:
        p = self.prefixes.pop(tail)
        for handle in p.holders:
            del self.handles[handle]
        blocks = self.blocks
        for h in p.hashes:
            c = blocks[h] - 1
            if c:
                blocks[h] = c
            else:
                del blocks[h]

    def check_integrity(self) -> None:
        counts: dict[int, int] = {}
        for tail, p in self.prefixes.items():
            assert p.hashes and p.hashes[-1] == tail, f"retained prefix keyed {tail} ends with {p.hashes[-1:]}"
            assert p.holders or p.unnamed, f"retained prefix {tail} is held by nothing"
            assert all(self.handles.get(h) == tail for h in p.holders), (tail, p.holders, self.handles)
            for h in p.hashes:
                counts[h] = counts.get(h, 0) + 1
        assert counts == self.blocks, "retained block counts != the prefixes covering them"
        assert all(t in self.prefixes and h in self.prefixes[t].holders for h, t in self.handles.items()), \
            "a handle names a prefix that does not know it"
        assert len(self.blocks) <= self.max_blocks, (len(self.blocks), self.max_blocks)
        uses = [p.last_use for p in self.prefixes.values()]
        assert uses == sorted(uses), "retained prefixes out of last-use order"
        pushed = {t for _, _, t in self._deadlines}
        assert set(self.prefixes) <= pushed, "a retained prefix has no deadline entry"
