"""The boundaries in the import graph: the KV cache bookkeeping (kv/) and the scheduler import no
torch; the engine imports no disk-tier module (the tiers are the connector's and the worker's), and
importing it does not load the disk store; nothing under kv/ imports from the scheduler, the
runner or the engine; no package imports another's private names."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "prefixkv"


def _loaded(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", f"import sys; {code}; print(sorted(sys.modules))"],
                         capture_output=True, text=True, check=True).stdout
    return eval(out)


def _imports(path: Path) -> set[str]:
    """The modules a file imports (at any depth of its code: lazy imports count too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_kv_and_the_scheduler_import_no_torch():
    loaded = _loaded("import prefixkv.kv, prefixkv.kv.tiers, prefixkv.kv.managers, prefixkv.scheduler")
    assert "torch" not in loaded and "numpy" not in loaded, [m for m in loaded if m.startswith(("torch", "numpy"))]
    for f in [*sorted((PKG / "kv").glob("*.py")), PKG / "scheduler.py"]:
        heavy = {m for m in _imports(f) if m.split(".")[0] in ("torch", "numpy")}
        assert not heavy, (f.name, heavy)


def test_kv_imports_nothing_above_it():
    for f in sorted((PKG / "kv").glob("*.py")):
        above = {m for m in _imports(f) if m.startswith(("prefixkv.scheduler", "prefixkv.runner", "prefixkv.engine",
                                                         "prefixkv.model", "prefixkv.attention"))}
        assert not above, (f.name, above)


def test_the_engine_imports_no_disk_module():
    assert not {m for m in _imports(PKG / "engine.py") if "disk" in m}
    assert "disk" not in (PKG / "engine.py").read_text().lower()
    loaded = _loaded("import prefixkv.engine, prefixkv.llm")
    assert "prefixkv.runner.disk_store" not in loaded and "crc32c" not in loaded


def _package(module: str) -> str:
    """The package a module belongs to (a package is its own)."""
    path = PKG.parent.joinpath(*module.split("."))
    return module if path.is_dir() else module.rsplit(".", 1)[0]


def test_no_private_name_is_imported_across_packages():
    """A name with a leading underscore is its package's own: another package imports public names."""
    crossing = []
    for f in sorted(PKG.rglob("*.py")):
        mine = ".".join(f.relative_to(PKG.parent).with_suffix("").parts[:-1])
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("prefixkv"):
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                if private and _package(node.module) != mine:
                    crossing.append((str(f.relative_to(PKG.parent)), node.module, private))
    assert not crossing, crossing
