"""The host-memory tier under the device pool: bookkeeping of its slots. No torch.

When the device pool evicts a cached page, its KV (the layers of its group) is copied into a host
slot (write-back on eviction: kv/tiers.py) and the slot is keyed by the page's key (kv/keys.py:
its block's chain hash and its group). A request whose prefix hit goes on where the host tier holds
the pages gets fresh device pages, copied back from their slots before the step's forward pass,
and counts them as cached tokens.

Slots are a fixed number (the capacity bound is strict); the least recently used entry goes when
a new one needs a slot, but never one written in the same step (its copy has not run yet: giving
its slot again would put two copies on one slot). A slot read by a pending copy-in is in flight: no copy-out may reuse it
until the step that reads it has run (``deliver`` when its step goes to the worker,
``release_delivered`` at the next schedule).

Retained blocks (kv/retention.py: ``retained`` holds their hashes) are not pushed out while an
entry that is not retained can go; a page that is not retained never pushes a retained one out (it
is then not stored), a retained page pushes out the least recently used retained entry
(``num_retained_pushed_out``).

Each entry keeps its block's tokens and is matched only when they are equal too, so a hash
collision can never put another prefix's KV under attention.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container

from prefixkv.kv.keys import PageKey


class HostBlockCache:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots: must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._entries: OrderedDict[PageKey, tuple[int, tuple[int, ...]]] = OrderedDict()  # key -> (slot, tokens)
        self._in_flight: list[int] = []  # taken for a copy-in not yet handed to the worker
        self._delivered: list[int] = []  # handed over: free once that step has run
        # keys put since the step's copies were handed over: their copy-out has not run, so their
        # slot cannot be given again (nor spilled) within the step
        self._fresh: set[PageKey] = set()
        self.num_stored = 0  # blocks written (copy-outs)
        self.num_loaded = 0  # blocks read back (copy-ins)
        self.retained: Container[int] = ()  # block hashes spared while others can go
        self.num_retained_pushed_out = 0

    @property
    def num_used(self) -> int:
        return len(self._entries)

    def put(self, key: PageKey,
            tokens: tuple[int, ...]) -> tuple[int | None, tuple[PageKey, int, tuple[int, ...]] | None]:
        """(a slot for an evicted page: the caller copies its KV there before the slot is read,
        or None if the tier has no slot to give or already holds this page; the least recently
        used entry this pushed out, as (key, slot, tokens), for a lower tier to take before the
        slot is overwritten, or None)."""
        if key in self._entries:
            slot, have = self._entries[key]
            if have == tokens:
                self._entries.move_to_end(key)
                return None, None
            del self._entries[key]  # a colliding entry: replaced
            self._free.append(slot)
        pushed_out = None
        if not self._free:
            old_key = self._victim(key)
            if old_key is None:
                return None, None  # every slot is in flight, written this step or retained (or there are none)
            slot, old_tokens = self._entries.pop(old_key)
            pushed_out = (old_key, slot, old_tokens)
            self._free.append(slot)
        slot = self._free.pop()
        self._entries[key] = (slot, tokens)
        self._fresh.add(key)
        self.num_stored += 1
        return slot, pushed_out

    def _victim(self, key: PageKey) -> PageKey | None:
        """The entry a new page's slot comes from: the least recently used one not written this
        step and not retained; a retained page may push out a retained one."""
        retained, fresh, entries = self.retained, self._fresh, self._entries
        if not retained:
            return next((k for k in entries if k not in fresh), None)
        first_retained = None
        for k in entries:
            if k in fresh:
                continue
            if k[0] not in retained:
                return k
            if first_retained is None:
                first_retained = k
        if first_retained is not None and key[0] in retained:
            self.num_retained_pushed_out += 1
            return first_retained
        return None

    def lookup(self, key: PageKey, tokens: tuple[int, ...]) -> int | None:
        """The slot holding this page (same key and same tokens), else None. Touches it."""
        hit = self._entries.get(key)
        if hit is None or hit[1] != tokens:
            return None
        self._entries.move_to_end(key)
        return hit[0]

    def entries(self) -> list[tuple[PageKey, int, tuple[int, ...]]]:
        """(key, slot, tokens) of every entry."""
        return [(key, slot, tokens) for key, (slot, tokens) in self._entries.items()]

    def keys(self) -> list[PageKey]:
        return list(self._entries)

    def lookup_key(self, key: PageKey) -> int | None:
        """The slot of ``key`` if held (no touch, no token check: for a key ``lookup`` matched)."""
        hit = self._entries.get(key)
        return None if hit is None else hit[0]

    def take(self, key: PageKey) -> int:
        """Remove a looked-up entry whose page goes back to the device: its slot stays reserved
        until the copy-in has run."""
        slot, _ = self._entries.pop(key)
        self._in_flight.append(slot)
        self.num_loaded += 1
        return slot

    def deliver(self) -> None:
        self._delivered.extend(self._in_flight)
        self._in_flight.clear()
        self._fresh.clear()

    def release_delivered(self) -> None:
        self._free.extend(self._delivered)
        self._delivered.clear()

    def clear(self) -> None:
        """Forget every entry (their KV can no longer be trusted)."""
        self._free.extend(slot for slot, _ in self._entries.values())
        self._entries.clear()
        self._fresh.clear()
        self.deliver()
        self.release_delivered()

    def check_integrity(self) -> None:
        used = [slot for slot, _ in self._entries.values()]
        every = used + self._free + self._in_flight + self._delivered
        assert len(every) == len(set(every)) == self.num_slots, (
            f"host slots: {len(used)} used + {len(self._free)} free + {len(self._in_flight)} in flight "
            f"!= {self.num_slots} (or a slot counted twice)")
