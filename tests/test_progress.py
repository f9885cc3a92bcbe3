"""What the first run says while it works (prefixkv/progress.py): tqdm bars on a terminal, log lines
otherwise, nothing when asked to be quiet; and where the engine says it (the kernel build, weight
loading and packing, the KV cache, the tokenizer, offline batches, the CLI's --quiet)."""

from __future__ import annotations

import io
import logging
import os
import time

import pytest

from prefixkv import LLM, SamplingParams, progress
from prefixkv.progress import Task


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def plain_stderr(monkeypatch, capsys):
    """stderr that is not a terminal (pytest's capture) and no logging configured; ``.read()`` gives
    what was written to it since the last read."""
    monkeypatch.setattr(progress, "_logging_configured", lambda: False)  # (pytest's handler is on the root)
    monkeypatch.setenv("PREFIXKV_QUIET", "0")  # (restored after the test)

    class Err:
        @staticmethod
        def read() -> str:
            return capsys.readouterr().err

    return Err


def test_off_a_terminal_lines_when_it_starts_runs_and_ends(plain_stderr):
    with Task("building", min_s=0.2, every_s=0.6):
        time.sleep(1.3)
    lines = plain_stderr.read().splitlines()
    assert lines[0] == "prefixkv: building ..."  # announced at once
    assert any(line.startswith("prefixkv: building: ") and line.endswith(" s") for line in lines[1:-1])
    assert lines[-1].startswith("prefixkv: building: done in ")


def test_short_unannounced_work_says_nothing_and_long_work_says_its_count(plain_stderr):
    with Task("loading", total=5, unit="tensors", announce=False, min_s=0.6) as t:
        t.update(5)
    assert plain_stderr.read() == ""
    with Task("loading", total=5, unit="tensors", announce=False, min_s=0.2, every_s=60) as t:
        t.update(2, "two in")
        time.sleep(1.0)
    lines = plain_stderr.read().splitlines()
    assert lines[0].startswith("prefixkv: loading: 2/5 tensors, two in, ") and len(lines) == 2
    assert lines[1].startswith("prefixkv: loading: done in ")


def test_a_failure_is_said_as_one(plain_stderr):
    with pytest.raises(RuntimeError):
        with Task("building"):
            raise RuntimeError("cc failed")
    assert plain_stderr.read().splitlines()[-1].startswith("prefixkv: building: failed after ")


def test_configured_logging_gets_the_lines(caplog, monkeypatch):
    monkeypatch.setenv("PREFIXKV_QUIET", "0")  # (restored after the test)
    monkeypatch.setattr("sys.stderr", io.StringIO())
    with caplog.at_level(logging.INFO, logger="prefixkv"):
        with Task("converting x.gguf (once)", total=3, unit="tensors") as t:
            t.update(3)
    assert [r.getMessage() for r in caplog.records][0] == "converting x.gguf (once) (3 tensors) ..."
    assert caplog.records[-1].getMessage().startswith("converting x.gguf (once): done in ")


def test_on_a_terminal_a_bar(monkeypatch):
    monkeypatch.setenv("PREFIXKV_QUIET", "0")  # (restored after the test)
    term = FakeTerminal()
    monkeypatch.setattr("sys.stderr", term)
    with Task("converting x.gguf (once)", unit="tensors") as t:  # a clock until the total is known
        t.set_total(4)
        t.update(4, "the tokenizer")
    out = term.getvalue()
    assert "converting x.gguf (once)" in out and "4/4" in out and "the tokenizer" in out
    assert "prefixkv:" not in out  # the bar, not log lines


@pytest.mark.parametrize("how", ["env", "logger"])
def test_quiet(plain_stderr, monkeypatch, how):
    if how == "env":
        monkeypatch.setenv("PREFIXKV_QUIET", "1")
    else:
        monkeypatch.setattr(logging.getLogger("prefixkv"), "level", logging.WARNING)
    assert progress.quiet()
    term = FakeTerminal()
    with Task("building", min_s=0.1, every_s=0.1):
        time.sleep(0.6)
    monkeypatch.setattr("sys.stderr", term)
    with Task("loading", total=2) as t:
        t.update(2)
    assert plain_stderr.read() == "" and term.getvalue() == ""


def test_the_kernel_build_says_so_once(plain_stderr, monkeypatch, tmp_path):
    """A build (here of a one-function source: the same _build the kernels take) is announced and
    timed; the next load finds it built and says nothing."""
    from prefixkv import cpu_ops

    cc = cpu_ops._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("PREFIXKV_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "one.c"
    src.write_text("int one(void) { return 1; }\n")
    first = cpu_ops._build(cc, src)
    lines = plain_stderr.read().splitlines()
    assert lines[0] == "prefixkv: building the CPU kernels (one.c, once per machine) ..."
    assert lines[-1].startswith("prefixkv: building the CPU kernels (one.c, once per machine): done in ")
    assert cpu_ops._build(cc, src) == first and plain_stderr.read() == ""


class Recorded(Task):
    made: list["Recorded"] = []

    def __init__(self, desc, total=None, unit="it", announce=True, **kw):
        super().__init__(desc, total, unit, announce, **kw)
        Recorded.made.append(self)


@pytest.fixture
def recorded(monkeypatch):
    Recorded.made = []
    for where in ("prefixkv.engine", "prefixkv.llm", "prefixkv.model.loader", "prefixkv.runner.model_runner",
                  "prefixkv.cpu_ops"):
        monkeypatch.setattr(f"{where}.Task", Recorded)
    return Recorded.made


def test_loading_an_engine_and_an_offline_batch_count_their_work(tiny_llama, recorded):
    llm = LLM(model=str(tiny_llama), dtype="float32", num_kv_blocks=64)
    by_desc = {t.desc: t for t in recorded}
    weights = by_desc[f"loading {tiny_llama.name}"]  # every parameter of the model, one by one
    assert weights.unit == "tensors" and weights.n == weights.total > 0
    assert "loading the tokenizer" in by_desc and any(d.startswith("allocating the KV cache (") for d in by_desc)
    if any(getattr(m, "kind", None) == "c" for m in llm.engine.runner.model.modules()):
        assert "packing the weights for the c GEMM" in by_desc
    recorded.clear()
    prompts = ["a b c", "d e", "f"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0))  # use_tqdm: on by default
    (batch,) = recorded
    assert (batch.desc, batch.total, batch.n, batch.unit) == ("generate", 3, 3, "req")
    assert batch.postfix.endswith("output tok/s")
    recorded.clear()
    assert [o.text for o in llm.chat([[{"role": "user", "content": p}] for p in prompts[:2]],
                                     SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)]
    assert recorded == [] and len(outs) == 3


def test_the_cli_quiet_flag(tiny_llama, monkeypatch, capsys):
    from prefixkv import cli

    monkeypatch.setenv("PREFIXKV_QUIET", "0")  # (restored after the test)
    assert cli.main(["generate", "hi", "--model", str(tiny_llama), "--max-tokens", "2", "--num-kv-blocks", "64", "--quiet"]) == 0
    assert os.environ["PREFIXKV_QUIET"] == "1" and progress.quiet()
    assert capsys.readouterr().err == ""
    assert cli.build_parser().parse_args(["serve", "-q"]).quiet


def test_progress_never_writes_to_stdout(plain_stderr, capsys):
    with Task("building", min_s=0.1, every_s=0.1):
        time.sleep(0.4)
    assert capsys.readouterr().out == ""
