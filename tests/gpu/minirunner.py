"""Runs tests/gpu where pytest is not installed (a lent GPU machine may have only torch,
transformers and cupy): ``python tests/gpu/minirunner.py [--json OUT.json] [-k SUBSTR] [FILE ...]``.

It installs a small stand-in ``pytest`` module covering what tests/gpu use -- ``mark.parametrize``
(stacked), other marks as no-ops, ``fixture`` (``scope`` function, module or the whole run, ``params``,
``autouse``, generator teardown, the built-ins ``request``, ``tmp_path``, ``tmp_path_factory``),
``skip`` (also module level), ``importorskip`` and ``raises(match=)`` -- then collects the
``test_*`` functions of each file, runs them in order and prints one line per test as it ends
(so a run cut short by a timeout still shows what passed). Exit status 0 when nothing failed.
With the real pytest importable it is not used unless ``--force-shim`` is given.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import itertools
import json
import re
import shutil
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent


class Skipped(Exception):
    pass


class _MarkDecorator:
    def __init__(self, name: str, args: tuple = (), kwargs: dict | None = None) -> None:
        self.name, self.args, self.kwargs = name, args, kwargs or {}

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:  # used as a decorator
            args[0].__dict__.setdefault("_marks", []).append(self)
            return args[0]
        return _MarkDecorator(self.name, args, kwargs)


class _Mark:
    def __getattr__(self, name: str) -> _MarkDecorator:
        return _MarkDecorator(name)

    @staticmethod
    def parametrize(argnames, argvalues, ids=None, **_):
        names = [n.strip() for n in argnames.split(",")] if isinstance(argnames, str) else list(argnames)

        def deco(func):
            rows = [tuple(v) if len(names) > 1 else (v,) for v in argvalues]
            labels = [ids(r[0]) if callable(ids) and len(names) == 1 else
                      ids[i] if isinstance(ids, (list, tuple)) else "-".join(_label(x) for x in r)
                      for i, r in enumerate(rows)]
            func.__dict__.setdefault("_params", []).insert(0, (names, list(zip(labels, rows))))
            return func

        return deco


def _label(x) -> str:
    s = str(x) if isinstance(x, (int, float, str, bool, type(None))) else getattr(x, "__name__", None) or str(x)
    return re.sub(r"[^\w.]+", "_", s)[:40]


def _fixture(func=None, *, scope: str = "function", params=None, autouse: bool = False, name=None, **_):
    def deco(f):
        f._fixture = dict(scope=scope, params=list(params) if params is not None else None, autouse=autouse,
                          name=name or f.__name__)
        return f

    return deco(func) if func is not None else deco


def _skip(reason: str = "", allow_module_level: bool = False) -> None:
    raise Skipped(reason)


def _importorskip(name: str, *_, **__):
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise Skipped(f"could not import {name!r}: {e}") from None


@contextlib.contextmanager
def _raises(exc, match=None):
    try:
        yield
    except exc as e:
        if match is not None and not re.search(match, str(e)):
            raise AssertionError(f"raised {type(e).__name__}({e!s}) does not match {match!r}") from e
        return
    raise AssertionError(f"DID NOT RAISE {exc}")


def make_shim() -> types.ModuleType:
    shim = types.ModuleType("pytest")
    shim.__dict__.update(mark=_Mark(), fixture=_fixture, skip=_skip, importorskip=_importorskip, raises=_raises,
                         Skipped=Skipped, __minirunner__=True)
    shim.skip.Exception = Skipped
    return shim


class _Request:
    def __init__(self, param=None) -> None:
        self.param = param


class _TmpPathFactory:
    def __init__(self, root: Path) -> None:
        self.root, self.count = root, itertools.count()

    def mktemp(self, basename: str, numbered: bool = True) -> Path:
        path = self.root / (f"{basename}{next(self.count)}" if numbered else basename)
        path.mkdir(parents=True)
        return path


class Runner:
    def __init__(self, tmp_root: Path) -> None:
        self.factory = _TmpPathFactory(tmp_root)
        self.cache: dict[tuple, object] = {}  # (scope key, fixture, param index) -> value
        self.finalizers: dict[str, list] = {"module": [], "run": []}
        self.results: list[dict] = []
        self.conftests: list | None = None

    # -- fixtures -------------------------------------------------------------------------------
    def __init_conftests(self) -> list:
        modules = []
        for i, path in enumerate((TESTS / "conftest.py", HERE / "conftest.py")):
            if path.is_file():
                spec = importlib.util.spec_from_file_location(f"gpu_minirunner_conftest{i}", path)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                modules.append(module)
        return modules

    def _fixtures_of(self, module) -> dict[str, object]:
        if self.conftests is None:
            self.conftests = self.__init_conftests()
        found = {}
        for mod in (*self.conftests, module):
            for obj in vars(mod).values():
                if callable(obj) and hasattr(obj, "_fixture"):
                    found[obj._fixture["name"]] = obj
        return found

    def _param_axes(self, names, fixtures, seen=None) -> list[tuple[str, int]]:
        """(fixture, number of params) for every parametrized fixture reachable from ``names``."""
        seen = set() if seen is None else seen
        axes = []
        for n in names:
            f = fixtures.get(n)
            if f is None or n in seen:
                continue
            seen.add(n)
            axes += self._param_axes(inspect.signature(f).parameters, fixtures, seen)
            if f._fixture["params"] is not None:
                axes.append((n, len(f._fixture["params"])))
        return axes

    def _value(self, name, fixtures, chosen, module_key, func_finalizers):
        if name == "request":
            return _Request()
        if name == "tmp_path_factory":
            return self.factory
        if name == "tmp_path":
            return self.factory.mktemp("tmp")
        f = fixtures.get(name)
        if f is None:
            raise LookupError(f"fixture {name!r} not found")
        info = f._fixture
        index = chosen.get(name)
        key = (module_key if info["scope"] == "module" else "run", name, index)
        if info["scope"] != "function" and key in self.cache:
            return self.cache[key]
        kwargs = {}
        for arg in inspect.signature(f).parameters:
            kwargs[arg] = (_Request(info["params"][index]) if arg == "request" and index is not None
                           else self._value(arg, fixtures, chosen, module_key, func_finalizers))
        value = f(**kwargs)
        if inspect.isgenerator(value):
            gen, value = value, next(value)
            fin = (lambda g=gen: next(g, None))
            (func_finalizers if info["scope"] == "function" else
             self.finalizers["module" if info["scope"] == "module" else "run"]).append(fin)
        if info["scope"] != "function":
            self.cache[key] = value
        return value

    # -- tests -----------------------------------------------------------------------------------
    def run_file(self, path: Path, keyword: str | None) -> None:
        rel = path.relative_to(TESTS.parent) if path.is_relative_to(TESTS.parent) else path
        module_name = f"gpu_minirunner_{path.stem}"
        t0 = time.perf_counter()
        try:
            spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
        except Skipped as e:
            self._report(str(rel), "skipped", time.perf_counter() - t0, str(e))
            return
        except Exception:  # noqa: BLE001 - a collection error is a failure of the file
            self._report(str(rel), "failed", time.perf_counter() - t0, traceback.format_exc())
            return
        fixtures = self._fixtures_of(module)
        autouse = [n for n, f in fixtures.items() if f._fixture["autouse"]]
        items = []
        for name, func in vars(module).items():
            if not (name.startswith("test") and inspect.isfunction(func)) or func.__module__ != module_name:
                continue
            argnames = list(inspect.signature(func).parameters)
            param_sets = func.__dict__.get("_params", [])
            direct = {n for names, _ in param_sets for n in names}
            axes = self._param_axes([*autouse, *(a for a in argnames if a not in direct)], fixtures)
            fixture_choices = itertools.product(*(range(k) for _, k in axes))
            for choice in fixture_choices:
                chosen = {n: i for (n, _), i in zip(axes, choice)}
                for combo in itertools.product(*(rows for _, rows in param_sets)):
                    labels = [f"{axes[i][0]}{c}" for i, c in enumerate(choice)] + [lab for lab, _ in combo]
                    values = {n: v for (names, _), (_, row) in zip(param_sets, combo) for n, v in zip(names, row)}
                    node = f"{rel}::{name}" + (f"[{'-'.join(labels)}]" if labels else "")
                    items.append((choice, node, func, argnames, values, chosen))
        items.sort(key=lambda it: it[0])  # group by fixture params: each module fixture set up once
        for _, node, func, argnames, values, chosen in items:
            if keyword and keyword not in node:
                continue
            self._run_one(node, func, argnames, values, chosen, fixtures, autouse, module_name)
        self._finalize("module")
        self.cache = {k: v for k, v in self.cache.items() if k[0] != module_name}

    def _run_one(self, node, func, argnames, values, chosen, fixtures, autouse, module_key) -> None:
        t0 = time.perf_counter()
        func_finalizers: list = []
        try:
            for n in autouse:
                self._value(n, fixtures, chosen, module_key, func_finalizers)
            kwargs = {a: values[a] if a in values else self._value(a, fixtures, chosen, module_key, func_finalizers)
                      for a in argnames}
            func(**kwargs)
            outcome, detail = "passed", ""
        except Skipped as e:
            outcome, detail = "skipped", str(e)
        except Exception:  # noqa: BLE001
            outcome, detail = "failed", traceback.format_exc()
        for fin in reversed(func_finalizers):
            fin()
        self._report(node, outcome, time.perf_counter() - t0, detail)

    def _finalize(self, scope: str) -> None:
        for fin in reversed(self.finalizers[scope]):
            with contextlib.suppress(Exception):
                fin()
        self.finalizers[scope] = []

    def _report(self, node: str, outcome: str, seconds: float, detail: str) -> None:
        self.results.append(dict(nodeid=node, outcome=outcome, seconds=round(seconds, 3), detail=detail[-4000:]))
        print(f"{node} {outcome.upper()} ({seconds:.2f}s)", flush=True)
        if outcome == "failed":
            print(detail, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", type=Path, help="test files (default: tests/gpu/test_*.py)")
    ap.add_argument("-k", dest="keyword", default=None, help="run only tests whose id contains this")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--force-shim", action="store_true", help="use the stand-in even if pytest is importable")
    args = ap.parse_args(argv)
    if not args.force_shim and importlib.util.find_spec("pytest") is not None:
        print("minirunner: pytest is importable; run `python -m pytest tests/gpu` (or pass --force-shim)")
        return 2
    sys.modules["pytest"] = make_shim()
    for p in (str(TESTS), str(TESTS.parent)):
        if p not in sys.path:
            sys.path.insert(0, p)
    files = [f.resolve() for f in args.files] or sorted(HERE.glob("test_*.py"))
    tmp_root = Path(tempfile.mkdtemp(prefix="gpu-minirunner-"))
    runner = Runner(tmp_root)
    t0 = time.perf_counter()
    try:
        for f in files:
            runner.run_file(f, args.keyword)
    finally:
        runner._finalize("run")
        shutil.rmtree(tmp_root, ignore_errors=True)
    counts = {k: sum(r["outcome"] == k for r in runner.results) for k in ("passed", "failed", "skipped")}
    print(f"minirunner: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped "
          f"in {time.perf_counter() - t0:.1f}s", flush=True)
    if args.json:
        args.json.write_text(json.dumps(dict(counts=counts, results=runner.results), indent=1))
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
