"""Runs the CUDA kernels of ``cuda/`` on the CPU, through a SIMT emulator (``simt_emu.h``).

The kernel sources are compiled as host C++ (g++) with ``PREFIXKV_EMULATOR`` defined: the same
text the GPU runs, minus the PTX branches (ldmatrix and mma.sync become the shuffle-based
equivalents in ``common.cuh``). ``emulated(...)`` then routes ``prefixkv.attention.cuda``'s
launches to it, so the real Python wrappers (argument checks, grids, template choice) run
unchanged on CPU tensors. It checks what a GPU test would and more: barriers reached by every
thread, cp.async data read only after its wait, shared memory read only after it is written,
aligned vector accesses. It says nothing about speed.

Races, two ways (see simt_emu.h):

* schedules: ``KernelEmulator.set_schedule`` runs the grid's CTAs and a CTA's threads in reverse or
  in a seeded random order, every barrier and shuffle a switch point (``interleave``);
  ``same_under_schedules`` runs a function under each and compares its outputs bitwise with index
  order's. A kernel whose output depends on the order of its warps or CTAs differs.
* ``race_check=True`` builds the emulator with every load and store instrumented
  (``g++ -fsanitize=thread``, our own hooks) and fails a launch at the first shared-memory access
  that conflicts with another thread's with no barrier between (``__syncwarp`` within a warp,
  ``__syncthreads`` across warps; shuffles order nothing), whatever the schedule.

Both apply to any emulated test from the environment: ``PREFIXKV_EMU_SCHEDULE=reverse`` (or
``random:SEED``; interleaved) and ``PREFIXKV_EMU_RACE_CHECK=1`` set what ``KernelEmulator.for_names``
builds and how it schedules, e.g. ``PREFIXKV_EMU_RACE_CHECK=1 PREFIXKV_EMU_SCHEDULE=random:3
pytest tests/test_kernel_emulation.py``.

Builds are cached in ``build/kernel_emu/`` by a hash of the sources, the instantiation list and flags.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CUDA_DIR = ROOT / "prefixkv" / "cuda"
BUILD_DIR = ROOT / "build" / "kernel_emu"
# -fno-gnu-unique and -Bsymbolic (below): every build's symbols are its own, also the kernels' static
# __shared__ arrays, when several builds (say a mutated kernel's) are loaded in one process
CXXFLAGS = ("-std=c++17", "-O2", "-fPIC", "-fno-strict-aliasing", "-ffp-contract=off", "-fno-gnu-unique",
            "-DPREFIXKV_EMULATOR", "-Wno-attributes")
# the race-check build: every load and store calls the __tsan_* hooks of simt_emu.h (no TSan
# runtime linked); -g1 so a race's code address resolves to a source line (addr2line)
RACE_CXXFLAGS = ("-fsanitize=thread", "--param=tsan-instrument-func-entry-exit=0", "-DPREFIXKV_EMU_RACE", "-g1")
SCHEDULES = {"index": 0, "reverse": 1, "random": 2}


class EmulatorError(RuntimeError):
    """The emulated kernel broke a rule a GPU would (misaligned access, deadlock, ...)."""


def find_compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")


_SHARED_DECL = re.compile(r"^(\s*(?:alignas\(\d+\)\s+)?__shared__\s+[\w:]+\s+(\w+)(?:\[[^\]]+\])+;)", re.M)


def _sources() -> dict[str, str]:
    """cuda/* with every reinterpret_cast turned into an alignment-checked cast, and every
    __shared__ array poisoned (NaN bytes) at the start of each CTA."""
    out = {}
    for path in sorted(CUDA_DIR.iterdir()):
        if path.suffix in (".cu", ".cuh"):
            text = re.sub(r"\breinterpret_cast<", "emu_aligned_cast<", path.read_text())
            text = _SHARED_DECL.sub(r'\1 emu_poison_shared(\2, sizeof(\2), "\2");', text)
            for line in text.splitlines():
                code = line.split("//")[0]
                if "__shared__" in code and "emu_poison_shared" not in code:
                    raise RuntimeError(f"kernel_emu: cannot instrument this shared declaration in {path.name}: "
                                       f"{line.strip()!r} (declare one array per line)")
            out[path.name] = text
    return out


def build(name_exprs: Iterable[str], race_check: bool = False) -> Path:
    """Compiles the emulator with these kernel instantiations (name expressions as the CUDA
    wrapper writes them); returns the shared library (cached)."""
    return build_from_sources(_sources(), name_exprs, race_check)


def build_from_sources(sources: dict[str, str], name_exprs: Iterable[str], race_check: bool = False) -> Path:
    """``build`` from given (already instrumented) sources, e.g. deliberately broken ones."""
    cxx = find_compiler()
    if cxx is None:
        raise FileNotFoundError("no C++ compiler (g++) for the kernel emulator")
    names = sorted(set(name_exprs))
    instances = "".join(f"  EMU_REG({n});\n" for n in names)
    flags = CXXFLAGS + (RACE_CXXFLAGS if race_check else ())
    key = hashlib.sha256()
    for text in (*sources.values(), (HERE / "simt_emu.h").read_text(), (HERE / "harness.cpp").read_text(),
                 instances, " ".join(flags), cxx):
        key.update(text.encode())
    digest = key.hexdigest()[:16]
    lib = BUILD_DIR / f"emu-{digest}.so"
    if lib.is_file():
        return lib
    src_dir = BUILD_DIR / f"src-{digest}"
    src_dir.mkdir(parents=True, exist_ok=True)
    for name, text in sources.items():
        (src_dir / name).write_text(text)
    (src_dir / "instances.inc").write_text(instances)
    tmp = lib.with_suffix(f".{os.getpid()}.tmp")
    # compiled and linked apart: the race build's objects call our hooks, not a linked TSan runtime
    obj = tmp.with_suffix(".o")
    for cmd in ([cxx, *flags, "-c", f"-I{src_dir}", f"-I{HERE}", str(HERE / "harness.cpp"), "-o", str(obj)],
                [cxx, "-shared", "-Wl,-Bsymbolic", str(obj), "-o", str(tmp)]):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"building the kernel emulator failed:\n{' '.join(cmd)}\n{proc.stderr[-6000:]}")
    obj.unlink()
    os.replace(tmp, lib)
    shutil.rmtree(src_dir, ignore_errors=True)
    return lib


class KernelEmulator:
    """The emulated kernels of one build. ``rebuild=True``: a launch of an instantiation the build
    lacks rebuilds it with that one added (seconds; list them up front to avoid it).
    ``race_check=True``: the instrumented build (see the module docstring), checking every launch."""

    def __init__(self, lib_path: Path, name_exprs: Iterable[str] = (), rebuild: bool = False,
                 race_check: bool = False) -> None:
        self.names = set(name_exprs)
        self.rebuild = rebuild
        self.race_check = race_check
        self.num_launches = 0
        self.schedule = ("index", 0, False)
        self._load(lib_path)

    def _load(self, lib_path: Path) -> None:
        self.lib_path = lib_path
        self.lib = ctypes.CDLL(str(lib_path))
        self.lib.emu_last_error.restype = ctypes.c_char_p
        self.lib.emu_launch.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                                        ctypes.c_int, ctypes.c_int, ctypes.c_int]
        self.lib.emu_set_schedule.argtypes = [ctypes.c_int, ctypes.c_ulonglong, ctypes.c_int]
        if not self.lib.emu_set_race_check(int(self.race_check)):
            raise RuntimeError(f"{lib_path.name}: not a race-check build")
        self.set_schedule(*getattr(self, "schedule", ("index", 0, False)))

    @classmethod
    def for_names(cls, name_exprs: Iterable[str], race_check: bool | None = None) -> KernelEmulator:
        """A build of these instantiations that rebuilds for others launched. ``race_check`` None:
        as $PREFIXKV_EMU_RACE_CHECK says; the schedule as $PREFIXKV_EMU_SCHEDULE says (index order)."""
        names = set(name_exprs)
        if race_check is None:
            race_check = os.environ.get("PREFIXKV_EMU_RACE_CHECK", "") not in ("", "0")
        emulator = cls(build(names, race_check), names, rebuild=True, race_check=race_check)
        order, _, seed = os.environ.get("PREFIXKV_EMU_SCHEDULE", "index").partition(":")
        if order != "index":
            emulator.set_schedule(order, int(seed or 0), interleave=True)
        return emulator

    def has(self, name_expr: str) -> bool:
        return bool(self.lib.emu_has_kernel(name_expr.encode()))

    def set_schedule(self, order: str = "index", seed: int = 0, interleave: bool = False) -> None:
        """How the next launches order CTAs and threads: "index", "reverse" or "random" (seeded;
        the stream continues from launch to launch); ``interleave``: the thread that completes a
        barrier or shuffle yields too."""
        self.schedule = (order, seed, interleave)
        self.lib.emu_set_schedule(SCHEDULES[order], seed, int(interleave))

    def launch(self, name_expr: str, grid: tuple[int, int, int], block: int, args: tuple) -> None:
        """``args`` as the wrapper passes them to CuPy: Python ints are pointers, numpy scalars
        are by value."""
        values = []
        for a in args:
            if isinstance(a, np.int32):
                values.append(ctypes.c_int32(int(a)))
            elif isinstance(a, np.int64):
                values.append(ctypes.c_int64(int(a)))
            elif isinstance(a, np.float32):
                values.append(ctypes.c_float(float(a)))
            elif type(a) is int:
                values.append(ctypes.c_uint64(a))
            else:
                raise TypeError(f"{name_expr}: unexpected kernel argument {a!r} ({type(a).__name__})")
        if self.rebuild and not self.has(name_expr):
            self.names.add(name_expr)
            self._load(build(self.names, self.race_check))
        ptrs = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p)
                                                         for v in values])
        rc = self.lib.emu_launch(name_expr.encode(), ptrs, *grid, block)
        self.num_launches += 1
        if rc != 0:
            error = self._where(self.lib.emu_last_error().decode())
            raise EmulatorError(f"{name_expr} grid={grid} block={block}: {error}")

    def _where(self, message: str) -> str:
        """A race's code address as file:line (addr2line, where installed)."""
        m = re.search(r"\[pc (0x[0-9a-f]+)\]", message)
        tool = shutil.which("addr2line")
        if m is None or tool is None:
            return message
        res = subprocess.run([tool, "-e", str(self.lib_path), "-i", m.group(1)], capture_output=True, text=True)
        lines = [Path(line).name for line in res.stdout.split() if ":" in line and not line.startswith("??")]
        return message.replace(m.group(0), f"[{' <- '.join(lines)}]") if lines else message


def same_under_schedules(emulator: KernelEmulator, run: Callable[[], object], seeds: Iterable[int] = (1, 2),
                         orders: Iterable[str] = ("reverse", "random")) -> dict[str, object]:
    """Runs ``run`` (which launches kernels under ``emulated(emulator)`` on fresh inputs and returns
    tensors, or a tuple / list / dict of them) in index order, then in every other ``orders`` with
    every barrier and shuffle interleaved ("random" once per seed), and asserts that each returns
    bitwise what index order did. Returns {schedule: outputs} (index order's under "index")."""
    import torch

    def flat(x):
        if isinstance(x, torch.Tensor):
            return [x]
        if isinstance(x, dict):
            return [t for k in sorted(x) for t in flat(x[k])]
        if isinstance(x, (list, tuple)):
            return [t for v in x for t in flat(v)]
        raise TypeError(f"outputs must be tensors, got {type(x).__name__}")

    saved = emulator.schedule
    results = {}
    try:
        emulator.set_schedule("index")
        results["index"] = want = flat(run())
        for order in orders:
            for seed in (seeds if order == "random" else (0,)):
                name = f"{order}-{seed}" if order == "random" else order
                emulator.set_schedule(order, seed, interleave=True)
                results[name] = got = flat(run())
                assert len(got) == len(want), name
                for i, (g, w) in enumerate(zip(got, want)):
                    assert torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)), (
                        f"output {i} under the {name} schedule differs bitwise from index order "
                        f"({int((g != w).sum())} elements of {g.numel()})")
    finally:
        emulator.set_schedule(*saved)
    return results


@contextlib.contextmanager
def emulated(emulator: KernelEmulator | None, num_sms: int = 4, capability: tuple[int, int] = (9, 0),
             record: set[str] | None = None) -> Iterator[None]:
    """Routes ``prefixkv.attention.cuda`` to the emulator (CPU tensors accepted as device tensors;
    ``num_sms`` / ``capability`` stand in for the device's). With ``emulator=None`` launches are
    only recorded in ``record`` (to learn which instantiations a set of calls needs)."""
    from prefixkv.attention import cuda as backend

    def launch(file_name, name_expr, grid, block, args, device):
        if record is not None:
            record.add(name_expr)
        if emulator is not None:
            emulator.launch(name_expr, grid, block, args)

    saved = backend._launch, backend._require_cuda, backend._device_info
    backend._launch = launch
    backend._require_cuda = lambda t, name: None
    backend._device_info = lambda index: (num_sms, capability)
    try:
        yield
    finally:
        backend._launch, backend._require_cuda, backend._device_info = saved
