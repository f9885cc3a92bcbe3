"""Host tensors backed by transparent huge pages (Linux), for the large buffers the CPU path streams
through every step: the packed GEMM weights and the KV cache.

With 4 KB pages a decode step over SmolLM2's 538 MB of packed weights crosses ~130,000 pages, and
a paged KV cache touches several new pages per block it reads (a 16-token block of one layer is
24 KB, at a place the block table picks); the TLB misses and the hardware prefetchers, which stop
at page boundaries, cost time. ``empty`` asks the kernel for 2 MB pages (``madvise(MADV_HUGEPAGE)``
before the memory is first touched, as the default ``transparent_hugepage=madvise`` requires). It
changes which pages hold the bytes, never their values. Where the call is not available (another OS,
THP off, a small tensor) it returns a plain ``torch.empty``.
"""

from __future__ import annotations

import ctypes
import os
import sys

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MIN_BYTES = 2 * HUGE_PAGE  # a smaller tensor may hold no aligned huge page

_madvise = None


def _libc_madvise():
    global _madvise
    if _madvise is None:
        fn = False
        if sys.platform.startswith("linux"):
            try:
                f = ctypes.CDLL(None, use_errno=True).madvise
                f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
                fn = f
            except (OSError, AttributeError):
                fn = False
        _madvise = fn
    return _madvise or None


def available() -> bool:
    """True where ``empty`` can ask for huge pages (Linux, THP not ``never``, madvise callable)."""
    if os.environ.get("PREFIXKV_HUGEPAGES", "1") == "0" or _libc_madvise() is None:
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def empty(shape: tuple[int, ...] | list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` (CPU, uninitialised) with the 2 MB-aligned part of its
    memory advised to be backed by huge pages: all of a large tensor, most of a few-MB one (no
    slack is allocated for alignment). Best effort: memory the allocator hands out already touched
    keeps its pages until the kernel collapses them. ``PREFIXKV_HUGEPAGES=0`` turns this off."""
    t = torch.empty(tuple(shape), dtype=dtype)
    advise(t)
    return t


def advise(t: torch.Tensor) -> bool:
    """Advise the 2 MB-aligned part of ``t``'s memory (CPU, contiguous) to be backed by huge pages;
    True if the kernel took the advice for at least one huge page."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or not t.is_contiguous() or nbytes < MIN_BYTES or not available():
        return False
    lo = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    hi = (t.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
    return hi > lo and _libc_madvise()(lo, hi - lo, MADV_HUGEPAGE) == 0
