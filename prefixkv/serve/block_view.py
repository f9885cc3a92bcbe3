"""What one replica's prefix cache holds, as its KV events tell it (``--routing-cache-view events``):
the incremental form of its cache digest (serve/digest.py). No Ray, no sockets (the subscriber that
feeds it is serve/kv_subscriber.py).

A view keeps, per medium (kv/events.py: ``GPU`` the device pool, ``CPU`` the host tier,
``STORAGE`` the disk tier), the set of block hashes held there, in their published form
(``BlockHasher.external``). Batches are applied in sequence order: ``BlockStored`` adds its
hashes to its medium, ``BlockRemoved`` drops them from its medium (a copy in another medium stays
held), ``AllBlocksCleared`` empties every medium. Only KV cache group 0's events count (the pages
a digest lists).

Sequence numbers (the publisher's, from 0) keep the view whole: a batch past the next expected one
is a gap, which the subscriber fills from the replica's replay socket; a gap the replay cannot fill
(the batches left its buffer, or no replay socket) is ``lost``: the view restarts empty from the
batch it has, and is not ``synced`` until the replica's next cache digest taken after the loss is
folded in (``fold_digest``; the router matches the digest meanwhile).

The router reads a view from its own thread while the subscriber's thread applies batches:
``lock`` guards both.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prefixkv.kv.events import MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE
from prefixkv.kv.tiers import TIER_DEVICE, TIER_DISK, TIER_HOST
from prefixkv.serve.digest import PrefixMatch

MEDIA = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE)
TIER_MEDIUM = {TIER_DEVICE: MEDIUM_GPU, TIER_HOST: MEDIUM_CPU, TIER_DISK: MEDIUM_STORAGE}


class BlockView:
    def __init__(self) -> None:
        self.held: dict[str, set[int | bytes]] = {m: set() for m in MEDIA}
        self.next_seq = 0  # the sequence number of the next batch to apply
        self.synced = False  # every batch applied since seq 0, or since a digest folded in
        self.lost_at = -math.inf  # time.time() of the last gap that could not be filled
        self.last_ts = -math.inf  # the publisher's time of the last batch applied
        self.num_batches = 0
        self.num_lost = 0  # gaps that could not be filled
        self.lock = threading.Lock()
        self._media: dict[int | bytes, int] = {}  # block -> how many media hold it
        self._removed_since_loss: set[tuple[str, int | bytes]] = set()

    # ------------------------------------------------------------------ the subscriber's side
    def apply(self, seq: int, batch: Any) -> bool:
        """Apply a decoded ``KVEventBatch`` (kv_events.wire_schema) numbered ``seq``. False, and
        nothing changed, if batches before it are missing (a gap); a batch applied already is skipped."""
        with self.lock:
            if seq < self.next_seq:
                return True
            if seq > self.next_seq:
                return False
            self._apply(batch)
            self.next_seq = seq + 1
            self.last_ts = batch.ts
            self.num_batches += 1
            if seq == 0:
                self.synced = True
            return True

    def _apply(self, batch: Any) -> None:
        for e in batch.events:
            kind = type(e).__name__
            if kind == "AllBlocksCleared":
                self._clear()
                continue
            if getattr(e, "group_idx", None) not in (None, 0):
                continue
            medium = e.medium or MEDIUM_GPU
            if kind == "BlockStored":
                for h in e.block_hashes:
                    self._add(medium, h)
            elif kind == "BlockRemoved":
                s, media = self.held.setdefault(medium, set()), self._media
                for h in e.block_hashes:
                    if h in s:
                        s.remove(h)
                        if media[h] == 1:
                            del media[h]
                        else:
                            media[h] -= 1
                if not self.synced:
                    self._removed_since_loss.update((medium, h) for h in e.block_hashes)

    def _add(self, medium: str, h: int | bytes) -> None:
        s = self.held.setdefault(medium, set())
        if h not in s:
            s.add(h)
            self._media[h] = self._media.get(h, 0) + 1

    def _clear(self) -> None:
        for s in self.held.values():
            s.clear()
        self._media.clear()

    def caught_up(self) -> None:
        """A replay from seq 0 answered with nothing: the replica has published no batch yet."""
        with self.lock:
            if self.next_seq == 0:
                self.synced = True

    def lost(self, seq: int) -> None:
        """Batches before ``seq`` cannot be had: start again, empty, from ``seq``."""
        with self.lock:
            self._clear()
            self.next_seq = seq
            self.synced = False
            self.lost_at = time.time()
            self.num_lost += 1
            self._removed_since_loss.clear()

    # ------------------------------------------------------------------ the router's side
    def fold_digest(self, digest: Mapping[int, int], digest_time: float, external: Callable[[int], int]) -> bool:
        """Take in a cache digest (block hash -> tier) the replica published after the loss: its
        blocks join the view in their tier's medium, except those an event removed since the loss.
        ``external``: a digest key in the events' form. True: the view is synced again."""
        with self.lock:
            if self.synced or digest_time <= self.lost_at:
                return self.synced
            removed = self._removed_since_loss
            for h, tier in digest.items():
                medium = TIER_MEDIUM.get(tier, MEDIUM_GPU)
                x = external(h)
                if (medium, x) not in removed:
                    self._add(medium, x)
            removed.clear()
            self.synced = True
            return True

    def match(self, keys: Sequence[int | bytes]) -> PrefixMatch:
        """The leading ``keys`` (a prompt's block hashes in the events' form) held in some medium."""
        with self.lock:
            gpu = self.held[MEDIUM_GPU]
            others = [s for m, s in self.held.items() if m != MEDIUM_GPU]
            n = dev = 0
            for k in keys:
                if k in gpu:
                    dev += 1
                elif not any(k in s for s in others):
                    break
                n += 1
            return PrefixMatch(n, dev)

    @property
    def num_blocks(self) -> int:
        """Distinct blocks held in any medium."""
        return len(self._media)
