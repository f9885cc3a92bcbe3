"""What the serving processes (the engine core, the HTTP front ends) set up about themselves: the
garbage collector, thread counts, and watching another process end."""

from __future__ import annotations

import gc
import os

# Container allocations between young collections (CPython's default: 700). A step allocates a few
# objects per running request (scheduled entries, outputs, deltas): with 700, most of them were
# alive at a collection, were promoted and fed full collections; `bench scale` at 256 running:
# median host step 1.02 -> 0.91 ms, no full collection in 100 steps instead of one per ~70.
GC_YOUNG_THRESHOLD = 20_000


def tune_gc_for_serving() -> int:
    """Once a serving process has started: move everything alive (torch, transformers, the model,
    the server: ~2e5 objects in the engine core) out of the garbage collector's reach, as vLLM's
    engine core does (none of it is garbage, and each full collection walked it all: 0.1 s a pause
    here), and collect the young generation less often (``GC_YOUNG_THRESHOLD``). Done by ``prefixkv
    serve``'s processes only: the offline ``LLM`` lives in its caller's process, whose heap is the
    caller's. Returns the number of objects frozen."""
    gc.collect()
    gc.freeze()
    _, g1, g2 = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, g1, g2)
    return gc.get_freeze_count()


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, a container's cpuset included)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def engine_threads(num_cpus: int, num_front_ends: int = 1) -> int:
    """Threads of the engine core's compute pool (torch and the C kernels' OpenMP) on ``num_cpus``
    CPUs beside ``num_front_ends`` HTTP processes.

    Every CPU, up to 4 of them: a front end sleeps in epoll between a step's outputs and the next,
    and a compute pool one thread short is 38-56 % slower on a quiet 2-CPU machine (RESULTS.md,
    "CPU contention"), far more than the front end's share of a CPU costs it. From 5 CPUs on, one
    CPU per front end is left to the front ends, so that streaming many requests never preempts a
    compute thread that the others wait for at a barrier (OpenMP spins there)."""
    if num_cpus <= 4:
        return max(1, num_cpus)
    return max(1, num_cpus - num_front_ends)


def watch_exit(pid: int):
    """A file descriptor that becomes readable when process ``pid`` ends (Linux ``pidfd_open``: any
    process, not only a child, and a zombie counts as ended), or None where there is none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def is_alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie (for the platforms without ``pidfd_open``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


# OpenMP threads of the engine core that reach a barrier first spin this many iterations (libgomp's
# GOMP_SPINCOUNT; its default 300,000 when it thinks it has the CPUs to itself) before they sleep.
ENGINE_SPIN_COUNT = "1000"


def engine_environment() -> dict[str, str]:
    """Environment variables the engine-core process starts with (its OpenMP runtime reads them
    when it loads), unless this environment sets them: how its compute threads wait at a barrier.

    The core shares the CPUs with the front ends (and, in a benchmark, the load generator): a
    thread that spins at a barrier while the thread it waits for is descheduled burns that
    thread's CPU. Measured on this 2-CPU machine with other processes running (a tiny model's
    steps, the main thread stepping): 42 s with libgomp's default spinning, 12 s with 10,000
    iterations, 0.98 s with 1,000, 0.78 s stepping from a second thread (where libgomp, counting
    more threads than CPUs, already spins only 100). The in-process server steps from a second
    thread: 1,000 keeps the core's threads waiting as they did there."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return {}
    return {"GOMP_SPINCOUNT": ENGINE_SPIN_COUNT}
