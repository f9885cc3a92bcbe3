"""The disk tier's files: one per KV page, in ``<dir>/<fingerprint>/``.

A page is one KV cache group's KV of a block (kv/groups.py; a model without sliding windows has
one group, whose page holds every layer), keyed by ``(block hash, group)`` (kv/keys.py). The
fingerprint (``kv_fingerprint``) hashes what makes a page's KV valid: the model's config, its
weight files (names, sizes and their first and last MiB), the dtype, the block size, the per-page
KV shape, the groups' layers and ``FORMAT_VERSION``; a directory written by anything else is never
read.

A file: ``MAGIC``, then a header (block hash, group, block size, payload bytes, CRC-32C of the
payload), the block's tokens (int64), then the payload (its group's layers' K and V of the block,
the KV cache's dtype). Written to a temporary name and renamed, so a process killed mid-write leaves at most a
``.tmp`` file, which the next start deletes. ``scan`` (at start) reads every file whole and keeps
only those whose header, size, tokens and checksum agree; every later read checks them again (a
read in the step raises ``DiskKVError`` on a mismatch: the engine then fails the step's requests
rather than attend over wrong KV).

No file I/O runs in the engine step beyond a bound. ``write`` copies the page (a memcpy, so the
host slot can be reused at once) and queues the file for a writer thread; the step waits only
while more than ``write_queue_bytes`` of copies are queued. Reads are prefetched: the scheduler
(kv/tiers.py, through runner/tiers.py) calls ``prefetch`` for a waiting request whose prefix
continues on disk, a reader thread reads and checks the files into slots of one buffer (the
payload straight from the file into its slot), and the request is admitted once all of them are
in (it waits, the other requests go on; a pass that would admit it may wait for reads about to
end, ``wait_ready``, within the worker's bound); ``load_into`` in the step then copies the pages
out of their slots in one call. A page whose file is still queued is read from its copy. A file
that fails its check (prefetched, or read in the step) is deleted and reported by
``take_failed``, and the request recomputes from there. Both threads start on demand and end when
idle for a second.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from prefixkv import cpu_ops, hugepages
from prefixkv.kv.keys import PageKey

FORMAT_VERSION = 3  # 3: a file per page, its group in the header (2: per block; 1: zlib's CRC-32)
MAGIC = b"PKVBLK3\n"
_HEADER = struct.Struct("<qiiqI")  # block hash, group, block size, payload bytes, CRC-32C of the payload
_crc32c = None


def checksum(data) -> int:
    """CRC-32C of a bytes-like object: the ``crc32c`` package (SSE4.2 / ARMv8 CRC instructions,
    ~10x zlib's table CRC-32 here; it lets go of the GIL over large buffers, so the reader thread's
    checks run beside the step's Python)."""
    global _crc32c
    if _crc32c is None:
        try:
            from crc32c import crc32c as _crc32c
        except ImportError as e:  # a core dependency (pyproject.toml); said plainly where it is missing
            raise ImportError("the disk KV tier needs the crc32c package (pip install crc32c)") from e
    return _crc32c(data)


class DiskKVError(RuntimeError):
    def __init__(self, message: str, key: PageKey) -> None:
        super().__init__(message)
        self.key = key  # the page whose file failed


def kv_fingerprint(model_path: Path, dtype: torch.dtype, block_size: int, block_shape: tuple[int, ...],
                   layout: tuple = ()) -> str:
    """``layout``: what else decides which layers a page holds (the KV cache groups' layers)."""
    h = hashlib.sha256()
    p = Path(model_path)
    files = sorted(p.iterdir()) if p.is_dir() else [p]
    for f in files:
        if f.name == "config.json":
            h.update(f.read_bytes())
        elif f.suffix in (".safetensors", ".bin", ".gguf", ".pt"):
            size = f.stat().st_size
            h.update(f"{f.name}:{size}".encode())
            with open(f, "rb") as fh:
                h.update(fh.read(1 << 20))
                fh.seek(max(0, size - (1 << 20)))
                h.update(fh.read(1 << 20))
    h.update(json.dumps([FORMAT_VERSION, str(dtype), block_size, list(block_shape), list(layout)]).encode())
    return h.hexdigest()[:24]


class DiskKVStore:
    def __init__(self, root: str | os.PathLike, fingerprint: str, block_size: int, block_shape: tuple[int, ...],
                 dtype: torch.dtype, write_queue_bytes: int = 256 << 20, prefetch_bytes: int = 512 << 20) -> None:
        self.dir = Path(root) / fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)
        self.block_size = block_size
        self.block_shape = block_shape  # a page: [layers of its group, 2, KVH, block_size, D]
        self.dtype = dtype
        self.payload_bytes = int(np.prod(block_shape)) * torch.empty((), dtype=dtype).element_size()
        # at least one block each, whatever the bounds say
        self.write_queue_bytes = max(write_queue_bytes, self.payload_bytes)
        self.prefetch_bytes = max(prefetch_bytes, self.payload_bytes)
        self.num_bytes_written = 0
        self.num_bytes_read = 0  # pages handed to the step
        self.num_discarded = 0  # files found invalid (truncated, corrupt, foreign) and deleted
        self.num_prefetched = 0  # pages read by the reader thread
        self.num_sync_reads = 0  # pages the step had to read itself (not prefetched)
        self.num_write_waits = 0  # writes that waited for room in the queue
        self._cv = threading.Condition()
        # key -> [copy, tokens, queued writes of it]: files not written yet (reads take the copy)
        self._pending: dict[PageKey, list] = {}
        self._ops: queue.SimpleQueue = queue.SimpleQueue()  # ("w" | "d", key), in order
        self._writes_queued = 0  # ops queued or running
        self._writer: threading.Thread | None = None
        self._reads: queue.SimpleQueue = queue.SimpleQueue()
        self._reader: threading.Thread | None = None
        # prefetched blocks are read into slots of one buffer of prefetch_bytes (huge pages, made by
        # make_buffer (the engine, at start) or at the first prefetch, and kept: no allocation, page
        # faults or zeroing per read), taken out of it by one copy (load_into)
        self._num_slots = self.prefetch_bytes // self.payload_bytes
        self._arena: torch.Tensor | None = None  # [num_slots, *block_shape]
        self._free_slots: list[int] = []
        self._reading: dict[PageKey, int | None] = {}  # key -> its slot (None: a buffer of its own)
        self._ready: OrderedDict[PageKey, torch.Tensor] = OrderedDict()  # prefetched, least recently wanted first
        self._slot_of: dict[PageKey, int] = {}  # ready keys in a slot
        self._failed: set[PageKey] = set()  # keys whose file failed (read or write), not yet reported
        self._wanted_now: set[PageKey] = set()  # asked for by this scheduling pass (``begin_pass``)
        self.read_s_per_block: float | None = None  # the reader's recent pace (a moving average)

    def _path(self, key: PageKey) -> Path:
        return self.dir / f"{key[0] & 0xFFFFFFFFFFFFFFFF:016x}-{key[1]}.kvb"

    # ------------------------------------------------------------------ writes
    def write(self, key: PageKey, tokens: tuple[int, ...], block: torch.Tensor, owned: bool = False) -> None:
        """Queue the page's file; the page is copied now (its memory may be reused at once), unless
        ``owned``: a contiguous CPU tensor of the caller's own that nothing writes to again."""
        copy = block if owned else block.detach().to("cpu", copy=True).contiguous()
        assert copy.is_contiguous() and copy.device.type == "cpu"
        assert copy.numel() * copy.element_size() == self.payload_bytes, (copy.shape, self.payload_bytes)
        with self._cv:
            while self._pending_bytes() + self.payload_bytes > self.write_queue_bytes and self._pending:
                self.num_write_waits += 1
                self._cv.wait()
            entry = self._pending.get(key)
            if entry is None:
                self._pending[key] = [copy, tuple(tokens), 1]
            else:
                entry[0], entry[1], entry[2] = copy, tuple(tokens), entry[2] + 1
            self._put_op(("w", key))

    def delete(self, key: PageKey) -> None:
        with self._cv:
            self._drop_ready(key)
            self._put_op(("d", key))

    def flush(self) -> None:
        """Wait until every queued write and delete is done."""
        with self._cv:
            while self._writes_queued:
                self._cv.wait()

    def _pending_bytes(self) -> int:
        return len(self._pending) * self.payload_bytes

    def _put_op(self, op: tuple[str, PageKey]) -> None:  # under the lock
        self._ops.put(op)
        self._writes_queued += 1
        self._ensure_worker("_writer", self._ops, self._write_op, "prefixkv-disk-writer")

    def _ensure_worker(self, attr: str, q: queue.SimpleQueue, handle: Callable, name: str) -> None:  # under the lock
        if getattr(self, attr) is None:
            t = threading.Thread(target=self._serve, args=(attr, q, handle), name=name, daemon=True)
            setattr(self, attr, t)
            t.start()

    def _serve(self, attr: str, q: queue.SimpleQueue, handle: Callable) -> None:
        """A worker thread's loop: ``handle`` each item of ``q`` in order; idle for a second, it ends
        (deciding under the lock, where producers start a new one, so no item is left unserved)."""
        while True:
            try:
                item = q.get(timeout=1.0)
            except queue.Empty:
                with self._cv:
                    if q.empty():
                        setattr(self, attr, None)
                        return
                continue
            handle(item)

    def _write_op(self, op: tuple[str, PageKey]) -> None:
        kind, key = op
        path = self._path(key)
        ok = True
        if kind == "d":
            path.unlink(missing_ok=True)
        else:
            with self._cv:
                copy, tokens, _ = self._pending[key]
            payload = copy.view(torch.uint8).reshape(-1).numpy()  # (a view: written as it is)
            header = _HEADER.pack(key[0], key[1], len(tokens), self.payload_bytes, checksum(payload))
            tmp = path.with_suffix(".tmp")
            try:
                with open(tmp, "wb") as f:
                    f.write(MAGIC + header + np.asarray(tokens, dtype=np.int64).tobytes())
                    f.write(payload)
                os.replace(tmp, path)
            except OSError:
                ok = False
                tmp.unlink(missing_ok=True)
        with self._cv:
            if kind == "w":
                entry = self._pending[key]
                entry[2] -= 1
                if not entry[2]:
                    del self._pending[key]
                if ok:
                    self.num_bytes_written += self.payload_bytes
                else:
                    self._failed.add(key)
            self._writes_queued -= 1
            self._cv.notify_all()

    # ------------------------------------------------------------------ reads
    def begin_pass(self) -> None:
        """A new scheduling pass: the blocks earlier passes asked for may go again."""
        with self._cv:
            self._wanted_now.clear()

    def prefetch(self, keys: list[PageKey]) -> bool:
        """Whether every page of ``keys`` is in memory for ``load_into``; starts reading those that
        are not. The scheduler asks for its waiting requests in priority order each pass: to make
        room within ``prefetch_bytes``, a call evicts prefetched blocks that no earlier call of the
        pass asked for (least recently wanted first), and reads no more than fits (one request alone
        may go over: it is the only one then, its blocks beyond the slots in buffers of their own).
        Only the step's thread calls it, and ``load_into`` takes what it reported ready in the same
        step, so nothing reported ready goes before it is read."""
        with self._cv:
            self._wanted_now.update(keys)
            todo = [k for k in keys if k not in self._ready and k not in self._reading and k not in self._failed]
            for k in todo:
                if k in self._pending:
                    self._ready[k] = self._pending[k][0]
            todo = [k for k in todo if k not in self._ready]
            for k in [k for k in self._ready if k not in self._wanted_now]:
                if len(self._ready) + len(self._reading) + len(todo) <= self._num_slots:
                    break
                self._drop_ready(k)
            for k in keys:
                if k in self._ready:
                    self._ready.move_to_end(k)
            mine = set(keys)
            # (the loop below adds only this request's keys: whether others' are held is known now)
            others_held = any(k not in mine for k in self._ready) or any(k not in mine for k in self._reading)
            if todo:
                self._make_buffer()
            for k in todo:
                if len(self._ready) + len(self._reading) + 1 > self._num_slots and others_held:
                    break  # the earlier requests' blocks fill the room: this one's turn comes later
                slot = self._free_slots.pop() if self._free_slots else None
                self._reading[k] = slot
                self._reads.put(k)
                self._ensure_worker("_reader", self._reads, self._read_op, "prefixkv-disk-reader")
            return all(k in self._ready for k in keys)

    def make_buffer(self, max_blocks: int | None = None) -> None:
        """Make the prefetch buffer now (at most ``max_blocks`` slots: no more than the tier holds)
        and touch each of its pages, so that the first reads after a start (a restart's returning
        conversations) do not pay for faulting in fresh huge pages (~0.7 s for 512 MB here)."""
        with self._cv:
            if self._arena is None:
                self._make_buffer(max_blocks)
                self._arena.view(-1).view(torch.uint8)[::4096].zero_()  # (every page faulted in now)

    def _make_buffer(self, max_blocks: int | None = None) -> None:  # under the lock
        """(Its pages are faulted in by the reads that first use them, on the reader thread.)"""
        if self._arena is not None:
            return
        if max_blocks is not None:
            self._num_slots = max(1, min(self._num_slots, max_blocks))
        self._arena = hugepages.empty((self._num_slots, *self.block_shape), dtype=self.dtype)
        self._free_slots = list(range(self._num_slots - 1, -1, -1))

    def _drop_ready(self, key: PageKey) -> torch.Tensor | None:  # under the lock
        """Take ``key`` out of the prefetched blocks (its slot back to the free ones; the caller must
        be done with the tensor before the lock is next let go of if it was a slot)."""
        block = self._ready.pop(key, None)
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._free_slots.append(slot)
        return block

    def take_failed(self) -> list[PageKey]:
        """Keys whose file failed its check (deleted) or could not be written, since the last
        call: the caller forgets them, so the requests recompute those pages."""
        with self._cv:
            out = sorted(self._failed)
            self._failed.clear()
            return out

    @property
    def reads_in_flight(self) -> int:
        with self._cv:
            return len(self._reading)

    def wait_reads(self, timeout: float) -> None:
        """Sleep until a prefetch read completes (or ``timeout``), if one is running: for an engine
        whose only work is waiting for them."""
        with self._cv:
            if self._reading:
                self._cv.wait(timeout)

    def wait_ready(self, keys: list[PageKey], timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every block of ``keys`` (all asked for by ``prefetch``)
        to be read; whether they are. Gives up at once where a block is not being read (no room for
        it, or its file failed) or where the reader's recent pace says the reads ahead of and
        including these will not finish in time."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                missing = [k for k in keys if k not in self._ready]
                if not missing:
                    return True
                if any(k not in self._reading for k in missing):
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                if self.read_s_per_block is not None:
                    wanted = set(missing)
                    last = max(i for i, k in enumerate(self._reading) if k in wanted)  # (read in order)
                    if (last + 1) * self.read_s_per_block > left:
                        return False
                self._cv.wait(left)

    def _read_op(self, key: PageKey) -> None:
        with self._cv:
            slot = self._reading[key]
        block = self._arena[slot] if slot is not None else torch.empty(self.block_shape, dtype=self.dtype)
        t0 = time.perf_counter()
        try:
            ok = self._read_into(self._path(key), block) is not None
        except Exception:  # (anything: the file is discarded and its blocks recomputed; the thread goes on)
            ok = False
        dt = time.perf_counter() - t0
        with self._cv:
            if ok:  # the pace of reads that read a whole block
                pace = self.read_s_per_block
                self.read_s_per_block = dt if pace is None else 0.8 * pace + 0.2 * dt
            del self._reading[key]
            if ok:
                self._ready[key] = block
                if slot is not None:
                    self._slot_of[key] = slot
                self.num_prefetched += 1
            else:
                if slot is not None:
                    self._free_slots.append(slot)
                self._path(key).unlink(missing_ok=True)
                self._failed.add(key)
                self.num_discarded += 1
            self._cv.notify_all()

    def load_into(self, dst: torch.Tensor, pairs: list[tuple[PageKey, int]]) -> None:
        """``dst[:, :, i]`` = the KV of page ``key`` for each ``(key, i)``, where ``dst`` is
        [layers, 2, pages, KVH, block_size, D] (the KV cache, or a staging view of that
        layout): prefetched blocks in one copy out of their slots (``cpu_ops.copy_kv_blocks`` on
        the CPU), the others from their queued copy or read now. DiskKVError (before anything is
        copied) if a file read now is not what was written."""
        if not pairs:
            return
        taken, own = [], []
        with self._cv:  # what is ready now stays (only this thread takes or evicts ready blocks)
            for key, i in pairs:
                slot = self._slot_of.get(key)
                if slot is not None and key in self._ready:
                    taken.append((key, slot, i))
                else:
                    block = self._ready.pop(key, None)
                    if block is None and key in self._pending:
                        block = self._pending[key][0]
                    own.append((key, block, i))
        own = [(key, block if block is not None else self._read_sync(key), i) for key, block, i in own]
        if taken:
            cpu_ops.move_kv_blocks(self._arena.permute(1, 2, 0, *range(3, self._arena.dim())), dst,
                                   [(slot, i) for _, slot, i in taken])
        for _, block, i in own:
            dst[:, :, i] = block.to(dst.device)
        with self._cv:
            for key, _, _ in taken:
                self._drop_ready(key)
        self.num_bytes_read += len(pairs) * self.payload_bytes

    def read(self, key: PageKey) -> torch.Tensor:
        """The page's KV, [layers, 2, KVH, block_size, D], a tensor of the caller's own:
        prefetched, or from its queued copy, else read now; DiskKVError if the file is not what
        was written."""
        with self._cv:
            block = self._drop_ready(key)
            if block is not None:
                block = block.clone()
            elif key in self._pending:
                block = self._pending[key][0]
        if block is None:
            block = self._read_sync(key)
        self.num_bytes_read += self.payload_bytes
        return block

    def _read_sync(self, key: PageKey) -> torch.Tensor:
        """Read now; a file that fails is deleted and reported (``take_failed``) before the raise."""
        block = torch.empty(self.block_shape, dtype=self.dtype)
        try:
            parsed = self._read_into(self._path(key), block)
            error = None if parsed is not None and parsed[0] == key else "the file is corrupt"
        except OSError as e:
            error = str(e)
        if error is not None:
            self._path(key).unlink(missing_ok=True)
            with self._cv:
                self._failed.add(key)
                self.num_discarded += 1
            raise DiskKVError(f"disk KV page {self._path(key).name}: {error}", key)
        self.num_sync_reads += 1
        return block

    def _read_into(self, path: Path, block: torch.Tensor) -> tuple[PageKey, tuple[int, ...]] | None:
        """Read the file at ``path`` into ``block`` (contiguous, the payload's size) with one
        ``readv``: the header and tokens into a buffer of their own, the payload straight into
        ``block``. (key, tokens) if the file is whole and valid (magic, header, size,
        checksum), else None (``block`` then holds anything). OSError if it cannot be read."""
        n_head = len(MAGIC) + _HEADER.size + 8 * self.block_size
        head = bytearray(n_head)
        payload = block.view(torch.uint8).reshape(-1).numpy()
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if size != n_head + self.payload_bytes:
                return None
            n, views = 0, [memoryview(head), memoryview(payload)]
            while views:  # (one readv reads a regular file whole unless a signal cuts it short)
                got = os.readv(f.fileno(), views)
                if not got:
                    break
                n += got
                while views and got >= len(views[0]):
                    got -= len(views.pop(0))
                if views:
                    views[0] = views[0][got:]
        if n != size or not head.startswith(MAGIC):
            return None
        h, group, ntok, nbytes, crc = _HEADER.unpack_from(head, len(MAGIC))
        if ntok != self.block_size or nbytes != self.payload_bytes or checksum(payload) != crc:
            return None
        tokens = tuple(np.frombuffer(head, dtype=np.int64, count=ntok, offset=n_head - 8 * ntok).tolist())
        return (h, group), tokens

    def scan(self) -> list[tuple[PageKey, tuple[int, ...]]]:
        """(key, tokens) of every valid file, oldest first; invalid files and leftover temporary
        files are deleted."""
        found, scratch = [], torch.empty(self.block_shape, dtype=self.dtype)
        for path in sorted(self.dir.iterdir(), key=lambda q: q.stat().st_mtime):
            if path.suffix == ".tmp":
                path.unlink(missing_ok=True)
                continue
            try:
                parsed = self._read_into(path, scratch) if path.suffix == ".kvb" else None
            except OSError:
                parsed = None
            if parsed is None or path != self._path(parsed[0]):
                path.unlink(missing_ok=True)
                self.num_discarded += 1
                continue
            found.append(parsed)
        return found
