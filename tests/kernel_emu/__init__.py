"""Runs the CUDA kernels of ``cuda/`` on the CPU, through a SIMT emulator (``simt_emu.h``).

The kernel sources are compiled as host C++ (g++) with ``PREFIXKV_EMULATOR`` defined: the same
text the GPU runs, minus the PTX branches (ldmatrix and mma.sync become the shuffle-based
equivalents in ``common.cuh``). ``emulated(...)`` then routes ``prefixkv.attention.cuda``'s
launches to it, so the real Python wrappers (argument checks, grids, template choice) run
unchanged on CPU tensors. It checks what a GPU test would and more: barriers reached by every
thread, cp.async data read only after its wait, shared memory read only after it is written,
aligned vector accesses. It says nothing about speed, and it cannot show data races between
threads (fibers run one at a time).

Builds are cached in ``build/kernel_emu/`` by a hash of the sources and the instantiation list.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CUDA_DIR = ROOT / "prefixkv" / "cuda"
BUILD_DIR = ROOT / "build" / "kernel_emu"
CXXFLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared", "-fno-strict-aliasing", "-ffp-contract=off",
            "-DPREFIXKV_EMULATOR", "-Wno-attributes")


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
            text = _SHARED_DECL.sub(r"\1 emu_poison_shared(\2, sizeof(\2));", text)
            for line in text.splitlines():
                code = line.split("//")[0]
                if "__shared__" in code and "emu_poison_shared" not in code:
                    raise RuntimeError(f"kernel_emu: cannot instrument this shared declaration in {path.name}: "
                                       f"{line.strip()!r} (declare one array per line)")
            out[path.name] = text
    return out


def build(name_exprs: Iterable[str]) -> Path:
    """Compiles the emulator with these kernel instantiations (name expressions as the CUDA
    wrapper writes them); returns the shared library (cached)."""
    return build_from_sources(_sources(), name_exprs)


def build_from_sources(sources: dict[str, str], name_exprs: Iterable[str]) -> Path:
    """``build`` from given (already instrumented) sources, e.g. deliberately broken ones."""
    cxx = find_compiler()
    if cxx is None:
        raise FileNotFoundError("no C++ compiler (g++) for the kernel emulator")
    names = sorted(set(name_exprs))
    instances = "".join(f"  EMU_REG({n});\n" for n in names)
    key = hashlib.sha256()
    for text in (*sources.values(), (HERE / "simt_emu.h").read_text(), (HERE / "harness.cpp").read_text(),
                 instances, " ".join(CXXFLAGS), cxx):
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
    cmd = [cxx, *CXXFLAGS, f"-I{src_dir}", f"-I{HERE}", str(HERE / "harness.cpp"), "-o", str(tmp)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"building the kernel emulator failed:\n{' '.join(cmd)}\n{proc.stderr[-6000:]}")
    os.replace(tmp, lib)
    shutil.rmtree(src_dir, ignore_errors=True)
    return lib


class KernelEmulator:
    """The emulated kernels of one build. ``rebuild=True``: a launch of an instantiation the build
    lacks rebuilds it with that one added (seconds; list them up front to avoid it)."""

    def __init__(self, lib_path: Path, name_exprs: Iterable[str] = (), rebuild: bool = False) -> None:
        self.names = set(name_exprs)
        self.rebuild = rebuild
        self.num_launches = 0
        self._load(lib_path)

    def _load(self, lib_path: Path) -> None:
        self.lib = ctypes.CDLL(str(lib_path))
        self.lib.emu_last_error.restype = ctypes.c_char_p
        self.lib.emu_launch.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                                        ctypes.c_int, ctypes.c_int, ctypes.c_int]

    @classmethod
    def for_names(cls, name_exprs: Iterable[str]) -> KernelEmulator:
        names = set(name_exprs)
        return cls(build(names), names, rebuild=True)

    def has(self, name_expr: str) -> bool:
        return bool(self.lib.emu_has_kernel(name_expr.encode()))

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
            self._load(build(self.names))
        ptrs = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p)
                                                         for v in values])
        rc = self.lib.emu_launch(name_expr.encode(), ptrs, *grid, block)
        self.num_launches += 1
        if rc != 0:
            raise EmulatorError(f"{name_expr} grid={grid} block={block}: {self.lib.emu_last_error().decode()}")


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
