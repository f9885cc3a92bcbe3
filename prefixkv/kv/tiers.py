"""The host and disk tiers under the device pool, scheduler side: the ``TierConnector``. No torch, no I/O.

It decides, while the scheduler builds a step, what goes down a tier and what comes back up, and
hands the step's copies to the worker as one ``TierPlan`` (``take_plan``). The worker
(runner/tiers.py ``TierWorker``) owns the host KV tensor, the files and the copy threads and
streams, and runs each plan before the forward pass of its step::

    device pages --evicted: save--> host slots --pushed out (LRU): spill--> files
         ^                              |                                      |
         +------------ load ------------+------------ file load ---------------+

Pages, not blocks: a page is one KV cache group's KV of a block (kv/groups.py), keyed by
``(block hash, group)``; a model without sliding windows has one group, and its page is a block.

* Write-back on eviction: a page the device evicts to make room is copied to a host slot
  (``save``); the entry the host tier lets go of for it (its least recently used) is written to a
  file first (a spill), and the disk tier drops its own least recently used files past its size.
* A prefix hit that goes on in a lower tier (``holds``: ``KVCacheCoordinator.match_prefix``) gets
  fresh device pages, copied in before the step that reads them (``take`` then ``load``).
* Pages from files are read ahead by the worker's reader thread: a request is admitted once they
  are in memory (``ready``), and the reads of those that wait start early (``prefetch``).
* ``load_async`` (the worker copies on a side stream: CUDA): the requests whose pages a step
  loads compute from the next step on (the scheduler defers them), so no forward waits for a copy.

Contracts (what each call may change; when a result is valid):

* ``holds`` only reorders the tiers' LRU; its answer holds until the next ``save`` or ``take``.
* ``take`` removes the host entries it names (their slots stay reserved until the plan that
  reads them has run: the ``begin_step`` after it) and leaves files in place; ``load`` records
  where the taken pages go. Between the two the caller may evict (``save``).
* ``save`` may push host entries out (to files, in the same plan).
* ``take_plan`` ends the step: the plan must run before the forward pass of that step, in the
  order ``TierWorker.execute`` documents; everything decided before it is in it.
* ``reset`` follows a failed step: every host entry goes (their copies may not have run), and the
  files that step was to write (their contents unknown).

KV events (``attach_events``): every page a tier takes or lets go of is told, the host tier's as
"CPU", the disk tier's as "STORAGE" (kv/events.py); the files an earlier run left are told when
the log is attached.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from prefixkv.kv.disk_cache import DiskBlockIndex
from prefixkv.kv.events import MEDIUM_CPU, MEDIUM_STORAGE, KVEventLog
from prefixkv.kv.host_cache import HostBlockCache
from prefixkv.kv.keys import EvictedPage, LowerPage, PageKey

if TYPE_CHECKING:
    from prefixkv.request import Request

TIER_DEVICE, TIER_HOST, TIER_DISK = 0, 1, 2  # where a cached block is (cache_digest)


@dataclass(slots=True)
class TierPlan:
    """The lower tiers' copies of one step (plain data), run in this order: ``spills`` (before the
    saves reuse their slots), ``persists``, ``saves`` (pages evicted this step still hold their
    KV), ``loads``, ``file_loads``, then ``drops``."""

    spills: list[tuple[int, PageKey, tuple[int, ...]]] = field(default_factory=list)  # (host slot, key, tokens) -> file
    saves: list[tuple[int, int]] = field(default_factory=list)  # (device page, host slot)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device page)
    file_loads: list[tuple[PageKey, int]] = field(default_factory=list)  # (key, device page)
    drops: list[PageKey] = field(default_factory=list)  # files that go
    # (device page, key, tokens) -> file: a clean shutdown's writes (TierConnector.flush)
    persists: list[tuple[int, PageKey, tuple[int, ...]]] = field(default_factory=list)
    # no request of this step reads the pages of loads and file_loads (theirs were put off to the
    # next step, ``deferred``): the worker may copy them beside the forward pass as long as the
    # next step's forward waits for them
    load_async: bool = False
    deferred: list[Request] = field(default_factory=list)

    @property
    def has_copies(self) -> bool:
        return bool(self.spills or self.saves or self.loads or self.file_loads or self.drops or self.persists)


class TierReads(Protocol):
    """The worker's file reads as the connector uses them (runner/tiers.py ``TierWorker``)."""

    def begin_pass(self, has_running: bool) -> None:
        """A scheduling pass starts: sets how long it may wait for reads (``wait_ready``)."""

    def prefetch(self, keys: list[PageKey]) -> bool:
        """Whether every page of ``keys`` is in memory; starts reading those that are not."""

    def wait_ready(self, keys: list[PageKey]) -> bool:
        """Waits, within what is left of the pass's bound, for reads about to end; whether they did."""

    def take_failed(self) -> list[PageKey]:
        """Keys whose file failed its check or its write since the last call."""

    def wait_reads(self, timeout: float) -> None:
        """Sleeps until a read ends (or ``timeout``)."""


class TierWorkerInfo(Protocol):
    num_host_pages: int
    num_disk_pages: int
    loads_async: bool  # loads run beside the forward pass (a CUDA side stream)

    def stored_pages(self) -> list[tuple[PageKey, tuple[int, ...]]]:
        """(key, tokens) of every valid file found at start, oldest first."""


class TierConnector:
    def __init__(self, num_host_pages: int = 0, num_disk_pages: int = 0) -> None:
        self.host = HostBlockCache(num_host_pages) if num_host_pages else None
        self.disk = DiskBlockIndex(num_disk_pages) if num_disk_pages and self.host is not None else None
        self.reads: TierReads | None = None  # the worker's file reads (bind), with a disk tier
        self.load_async = False
        self._plan = TierPlan()  # the step being scheduled
        self._loading: set[int] = set()  # device pages the step's plan loads into
        self.num_read_waits = 0  # admissions put off while a request's pages were read from files
        self.events: KVEventLog | None = None  # KV events (attach_events); None: off

    @classmethod
    def bound_to(cls, worker: TierWorkerInfo) -> TierConnector:
        """The connector of the tiers this worker holds, bound to it."""
        connector = cls(worker.num_host_pages, worker.num_disk_pages)
        connector.bind(worker)
        return connector

    @property
    def enabled(self) -> bool:
        return self.host is not None

    def bind(self, worker: TierWorkerInfo) -> None:
        """Connect the worker: how it copies, its reads, and the files an earlier run left (the
        disk tier's index again; files past its size go with the first plan)."""
        self.load_async = worker.loads_async
        if self.disk is not None:
            self.reads = worker
            for key, tokens in worker.stored_pages():
                self._plan.drops.extend(self.disk.add(key, tokens))

    def attach_events(self, events: KVEventLog) -> None:
        """Tell ``events`` of every page the tiers take or let go of from now on, and of the files
        held now (an earlier run's)."""
        self.events = events
        if self.disk is not None:
            for key, tokens in self.disk.entries():
                events.copied(key[0], tokens, MEDIUM_STORAGE, key[1])

    def _to_disk(self, key: PageKey, tokens: tuple[int, ...]) -> list[PageKey]:
        """``disk.add``, told: the files that go for it are returned (for the plan's drops)."""
        new = key not in self.disk
        dropped = self.disk.add(key, tokens)
        if self.events is not None:
            if new:
                self.events.copied(key[0], tokens, MEDIUM_STORAGE, key[1])
            for k in dropped:
                self.events.dropped((k[0],), MEDIUM_STORAGE, k[1])
        return dropped

    # ------------------------------------------------------------------ the coordinator's calls
    def spare(self, retained: Container[int]) -> None:
        """The block hashes the host tier keeps while it can (kv/retention.py)."""
        if self.host is not None:
            self.host.retained = retained

    def holds(self, key: PageKey, tokens: tuple[int, ...]) -> bool:
        """Whether a lower tier has this page (same key and same tokens)."""
        return self.host.lookup(key, tokens) is not None or (self.disk is not None and self.disk.lookup(key, tokens))

    def save(self, evicted: Sequence[EvictedPage]) -> None:
        """Pages the device evicts: each to a host slot (a spill first for the entry that slot
        held, unless its file exists)."""
        plan, host, disk, events = self._plan, self.host, self.disk, self.events
        for e in evicted:
            slot, pushed_out = host.put(e.key, e.tokens)
            if pushed_out is not None and disk is not None and pushed_out[0] not in disk:
                key, old_slot, tokens = pushed_out
                if key in plan.drops:  # dropped earlier this step: its new file must stay
                    plan.drops.remove(key)
                plan.spills.append((old_slot, key, tokens))
                plan.drops.extend(self._to_disk(key, tokens))
            if pushed_out is not None and events is not None:  # (after its file is told: its hash stays known)
                events.dropped((pushed_out[0][0],), MEDIUM_CPU, pushed_out[0][1])
            if slot is not None:
                plan.saves.append((e.page, slot))
                if events is not None:
                    events.copied(e.key[0], e.tokens, MEDIUM_CPU, e.key[1])

    def take(self, pages: Sequence[LowerPage]) -> list[tuple[bool, int | PageKey]]:
        """Reserve the sources of a hit's lower-tier pages: (True, host slot) or (False, key)."""
        host = self.host
        out = [(True, host.take(r.key)) if host.lookup_key(r.key) is not None else (False, r.key) for r in pages]
        if self.events is not None:
            for r, (from_host, _) in zip(pages, out):
                if from_host:
                    self.events.dropped((r.key[0],), MEDIUM_CPU, r.group)
        return out

    def load(self, sources: Sequence[tuple[bool, int | PageKey]], pages: Sequence[int]) -> None:
        """Copy the taken sources into these device pages, before the step."""
        plan = self._plan
        for (from_host, src), page in zip(sources, pages):
            (plan.loads if from_host else plan.file_loads).append((src, page))
            self._loading.add(page)

    # ------------------------------------------------------------------ the scheduler's calls
    def begin_step(self, has_running: bool) -> None:
        """A new schedule: the copies handed to the worker last step have run."""
        if self.host is not None:
            self.host.release_delivered()
        self._loading.clear()
        if self.reads is not None:
            self._forget_failed()
            self.reads.begin_pass(has_running)

    def loads_into(self, blocks: Iterable[Sequence[int]]) -> bool:
        """Whether this step's plan copies into any of these device pages (a per-group table each)."""
        return bool(self._loading) and any(not self._loading.isdisjoint(t) for t in blocks)

    def _file_keys(self, pages: Sequence[LowerPage]) -> list[PageKey] | None:
        """The keys of a hit's pages that come from files, or None while one of them goes to its
        file in this very step (it can be read from the next step on)."""
        if not pages or self.reads is None:
            return []
        host = self.host
        keys = [r.key for r in pages if host.lookup_key(r.key) is None]
        spills = self._plan.spills
        if keys and spills and not {k for _, k, _ in spills}.isdisjoint(keys):
            return None
        return keys

    def ready(self, pages: Sequence[LowerPage], wait: bool) -> bool:
        """Whether a hit's pages from files are all in memory (their reads start otherwise; with
        ``wait``, a request this pass would admit, the worker may wait a bounded while). Files
        that failed their check are forgotten here, so the request's next match stops before them."""
        keys = self._file_keys(pages)
        if keys is not None and not keys:
            return True
        ok = keys is not None and self.reads.prefetch(keys)
        if not ok and wait and keys is not None:
            ok = self.reads.wait_ready(keys)
        self._forget_failed()
        if not ok:
            self.num_read_waits += 1
        return ok

    def prefetch(self, pages: Sequence[LowerPage]) -> None:
        """Start the file reads of a hit the scheduler does not admit now (a hint)."""
        keys = self._file_keys(pages)
        if keys:
            self.reads.prefetch(keys)

    def wait_for_reads(self, timeout: float) -> None:
        """Nothing to schedule but requests waiting for files: sleep until a read ends."""
        if self.reads is not None:
            self.reads.wait_reads(timeout)

    def _forget_failed(self) -> None:
        for key in self.reads.take_failed():
            self._remove_file(key)

    def _remove_file(self, key: PageKey) -> None:
        if self.events is not None and key in self.disk:
            self.events.dropped((key[0],), MEDIUM_STORAGE, key[1])
        self.disk.remove(key)

    def take_plan(self, deferred: list[Request]) -> TierPlan:
        """The step's copies, for the worker; the next step starts a new plan."""
        if self.host is not None:
            self.host.deliver()
        plan, self._plan = self._plan, TierPlan()
        plan.load_async, plan.deferred = self.load_async, deferred
        return plan

    def reset(self, failed: TierPlan) -> None:
        """After a failed step: every host entry goes, and the files that step was to write."""
        if self.host is None:
            return
        if self.events is not None:
            for key in self.host.keys():
                self.events.dropped((key[0],), MEDIUM_CPU, key[1])
        self.host.clear()
        if self.disk is not None:
            for _, key, _ in failed.spills + failed.persists:
                self._remove_file(key)

    def clear(self) -> TierPlan:
        """Forget every page of both tiers (``LLMEngine.reset_prefix_cache``, nothing running):
        returns the plan that deletes the files. Tells no event: the caller tells that everything
        is cleared."""
        plan = TierPlan()
        if self.host is None:
            return plan
        self.host.clear()
        if self.disk is not None:
            plan.drops = self.disk.keys()
            for key in plan.drops:
                self.disk.remove(key)
        return plan

    def flush(self, cached_pages: Iterable[tuple[int, PageKey, tuple[int, ...]]]) -> TierPlan:
        """A plan that writes every cached page the disk tier lacks (on the device, then in the
        host tier) to its file, so that a restart finds them (a clean shutdown)."""
        plan = TierPlan()
        if self.disk is None:
            return plan
        for page, key, tokens in cached_pages:
            if key not in self.disk:
                plan.persists.append((page, key, tokens))
                plan.drops.extend(self._to_disk(key, tokens))
        for key, slot, tokens in self.host.entries():
            if key not in self.disk:
                plan.spills.append((slot, key, tokens))
                plan.drops.extend(self._to_disk(key, tokens))
        return plan

    # ------------------------------------------------------------------ views
    def digest(self) -> dict[int, int]:
        """block hash -> TIER_HOST / TIER_DISK (the higher of the two) of group 0's pages."""
        out: dict[int, int] = {}
        if self.disk is not None:
            out.update((h, TIER_DISK) for h, g in self.disk.keys() if g == 0)
        if self.host is not None:
            out.update((h, TIER_HOST) for h, g in self.host.keys() if g == 0)
        return out

    def stats(self) -> dict[str, int]:
        host, disk = self.host, self.disk
        return {
            "num_host_blocks": host.num_slots if host else 0,
            "num_host_blocks_used": host.num_used if host else 0,
            "host_blocks_stored": host.num_stored if host else 0,
            "host_blocks_loaded": host.num_loaded if host else 0,
            "num_disk_blocks": disk.num_blocks if disk else 0,
            "num_disk_blocks_used": disk.num_used if disk else 0,
            "disk_admission_waits": self.num_read_waits,
        }

    def check_integrity(self) -> None:
        if self.host is not None:
            self.host.check_integrity()
        if self.disk is not None:
            self.disk.check_integrity()
