"""The host and disk tiers, worker side: the ``TierWorker`` owns the host KV tensor, the disk files
(runner/disk_store.py: their writer and reader threads) and the CUDA side stream, and runs the
connector's ``TierPlan`` before each step's forward pass (kv/tiers.py decides what is in it).

Host slots have the device pages' layout ([slots, 2, num_host_pages, KVH, block_size, D], pinned
when the device is a GPU, so their copies can be asynchronous); a file holds one page.

For the connector's admission it also answers, in the scheduler's thread, whether a hit's pages
from files are in memory (``prefetch``), and waits for reads about to end within a bound per
scheduling pass (``wait_ready``: no longer than the last forward pass took while requests run,
about the step a waiting request would otherwise lose, and never more than ``max_wait_s``: SGLang
HiCache's "timeout" prefetch policy).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from prefixkv import cpu_ops
from prefixkv.config import CacheConfig
from prefixkv.kv.keys import PageKey
from prefixkv.kv.tiers import TierPlan

if TYPE_CHECKING:
    from prefixkv.runner.disk_store import DiskKVStore

MAX_WAIT_S = 0.1  # the most a scheduling pass waits for a request's file reads


class TierWorker:
    def __init__(self, kv_cache: torch.Tensor, num_host_pages: int = 0, disk: DiskKVStore | None = None,
                 num_disk_pages: int = 0) -> None:
        self.kv_cache = kv_cache  # [slots, 2, num_pages + 1, KVH, block_size, D]
        self.device = kv_cache.device
        cuda = self.device.type == "cuda"
        slots, two, _, kvh, bs, d = kv_cache.shape
        self.num_host_pages = num_host_pages
        self.host_kv = (torch.zeros((slots, two, num_host_pages, kvh, bs, d), dtype=kv_cache.dtype, pin_memory=cuda)
                        if num_host_pages else None)
        self.disk = disk
        self.num_disk_pages = num_disk_pages if disk is not None else 0
        # CUDA: pages loaded back go into the device on a side stream from pinned memory, beside
        # the forward pass of the step that schedules them (TierPlan.load_async: the scheduler puts
        # their requests off to the next step, whose work waits for the copies)
        self.copy_stream = torch.cuda.Stream(device=self.device) if cuda and (num_host_pages or disk) else None
        self.loads_async = self.copy_stream is not None
        self._copies_in_flight = None  # the side stream's event after the last step's loads
        self.num_async_loaded_pages = 0
        self.max_wait_s = MAX_WAIT_S
        self.wait_left = 0.0  # seconds this scheduling pass may still wait for reads
        self.wait_s = 0.0  # waited so, in all
        self.num_waits_won = 0  # requests whose reads ended within such a wait
        self.last_forward_s = 0.0  # the last step's forward pass (ModelRunner.execute sets it)

    @classmethod
    def from_config(cls, cache: CacheConfig, kv_cache: torch.Tensor, model_path, layout: tuple) -> TierWorker:
        """The tiers ``cache`` asks for, in pages of ``kv_cache``'s layout; ``layout`` (the KV cache
        groups' layers) goes into the disk files' fingerprint."""
        page_bytes = kv_cache[:, :, 0].numel() * kv_cache.element_size()
        num_host = cache.host_cache_bytes // page_bytes
        if cache.host_cache_bytes and not num_host:
            raise ValueError(f"kv_host_cache_gb: {cache.host_cache_bytes} bytes hold no KV block ({page_bytes} "
                             f"bytes each)")
        disk, num_disk = None, 0
        if cache.disk_cache_dir is not None:  # (its module, and crc32c, load only then)
            from prefixkv.runner.disk_store import DiskKVStore, kv_fingerprint

            slots, two, _, kvh, bs, d = kv_cache.shape
            page_shape = (slots, two, kvh, bs, d)
            disk = DiskKVStore(cache.disk_cache_dir, kv_fingerprint(model_path, kv_cache.dtype, bs, page_shape, layout),
                               bs, page_shape, kv_cache.dtype)
            num_disk = cache.disk_cache_bytes // disk.payload_bytes
            if not num_disk:
                raise ValueError(f"kv_disk_cache_gb: {cache.disk_cache_bytes} bytes hold no KV block "
                                 f"({disk.payload_bytes} bytes each)")
            disk.make_buffer(num_disk)
        return cls(kv_cache, num_host, disk, num_disk)

    # ------------------------------------------------------------------ plans
    def execute(self, plan: TierPlan) -> None:
        """A step's copies, in this order: host slots the host tier let go of to files (before the
        saves reuse them), device pages to files (a clean shutdown), device pages out to host slots
        (pages evicted by this step and reused by it still hold their KV), host slots and files
        back in, then the files the disk tier dropped. With ``load_async`` on CUDA the pages that
        go back in are copied on the side stream (``_load_async``)."""
        if plan.spills:  # each page copied out of its slot now (the saves below may reuse the slot)
            staged = self._staging(len(plan.spills))
            cpu_ops.move_kv_blocks(self.host_kv, staged.permute(1, 2, 0, *range(3, staged.dim())),
                                   [(slot, i) for i, (slot, _, _) in enumerate(plan.spills)])
            for i, (_, key, tokens) in enumerate(plan.spills):
                self.disk.write(key, tokens, staged[i], owned=True)
        for page, key, tokens in plan.persists:
            self.disk.write(key, tokens, self.kv_cache[:, :, page])
        cpu_ops.move_kv_blocks(self.kv_cache, self.host_kv, plan.saves)
        if plan.load_async and self.copy_stream is not None and (plan.loads or plan.file_loads):
            self._load_async(plan)
        else:
            cpu_ops.move_kv_blocks(self.host_kv, self.kv_cache, plan.loads)
            if plan.file_loads:
                self.disk.load_into(self.kv_cache, plan.file_loads)
        for key in plan.drops:
            self.disk.delete(key)

    def wait_for_copies(self) -> None:
        """The compute stream waits for the last step's asynchronous loads (before anything reads them)."""
        if self._copies_in_flight is not None:
            torch.cuda.current_stream(self.device).wait_event(self._copies_in_flight)
            self._copies_in_flight = None

    def _staging(self, n: int, pin: bool = False) -> torch.Tensor:
        """A host buffer for n pages, [n, slots, 2, KVH, block_size, D]: a page a contiguous run (a
        file's payload); ``.permute(1, 2, 0, 3, 4, 5)`` is the cache's layout."""
        slots, two, _, kvh, bs, d = self.kv_cache.shape
        return torch.empty((n, slots, two, kvh, bs, d), dtype=self.kv_cache.dtype, pin_memory=pin)

    def _load_async(self, plan: TierPlan) -> None:
        """The step's loads and file loads as one batch: gathered into a pinned buffer here, then
        copied to the device and scattered into their pages on the side stream, which first waits
        for the work queued so far (earlier steps' kernels may still read those pages' old KV).
        The next step's ``wait_for_copies`` makes the compute stream wait for them."""
        pages = [p for _, p in plan.loads] + [p for _, p in plan.file_loads]
        k = len(plan.loads)
        staged = self._staging(len(pages), pin=True).permute(1, 2, 0, 3, 4, 5)
        cpu_ops.move_kv_blocks(self.host_kv, staged, [(h, i) for i, (h, _) in enumerate(plan.loads)])
        if plan.file_loads:
            self.disk.load_into(staged, [(key, k + i) for i, (key, _) in enumerate(plan.file_loads)])
        index = torch.tensor(pages, dtype=torch.int64).pin_memory()
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            self.kv_cache.index_copy_(2, index.to(self.device, non_blocking=True),
                                      staged.to(self.device, non_blocking=True))
            self._copies_in_flight = torch.cuda.Event()
            self._copies_in_flight.record(self.copy_stream)
        self.num_async_loaded_pages += len(pages)

    def flush(self) -> None:
        """Wait until every queued file write and delete is done."""
        if self.disk is not None:
            self.disk.flush()

    # ------------------------------------------------------------------ reads (kv/tiers.py TierReads)
    def stored_pages(self) -> list[tuple[PageKey, tuple[int, ...]]]:
        """(key, tokens) of every valid file an earlier run left, oldest first."""
        return self.disk.scan() if self.disk is not None else []

    def begin_pass(self, has_running: bool) -> None:
        self.disk.begin_pass()
        self.wait_left = min(self.max_wait_s, self.last_forward_s) if has_running else self.max_wait_s

    def prefetch(self, keys: list[PageKey]) -> bool:
        return self.disk.prefetch(keys)

    def wait_ready(self, keys: list[PageKey]) -> bool:
        """Wait for reads the reader's pace says end within what is left of this pass's bound:
        admitted now rather than a whole step later, at the cost of that wait to the running
        requests and to those after it in the queue."""
        if self.wait_left <= 0:
            return False
        t0 = time.perf_counter()
        ready = self.disk.wait_ready(keys, self.wait_left)
        waited = time.perf_counter() - t0
        self.wait_left -= waited
        self.wait_s += waited
        self.num_waits_won += ready
        return ready

    def take_failed(self) -> list[PageKey]:
        return self.disk.take_failed()

    def wait_reads(self, timeout: float) -> None:
        self.disk.wait_reads(timeout)

    def stats(self) -> dict[str, int | float]:
        d = self.disk
        return {
            "disk_bytes_written": d.num_bytes_written if d is not None else 0,
            "disk_bytes_read": d.num_bytes_read if d is not None else 0,
            "disk_files_discarded": d.num_discarded if d is not None else 0,
            "disk_blocks_prefetched": d.num_prefetched if d is not None else 0,
            "disk_sync_reads": d.num_sync_reads if d is not None else 0,
            "disk_wait_admissions": self.num_waits_won,
            "disk_wait_s": round(self.wait_s, 6),
            "async_promoted_blocks": self.num_async_loaded_pages,
        }
