"""README.md's quick start works as written: every code block marked ``<!-- runnable -->`` runs,
copied from the README, in order, from the repository root, against a ``prefixkv serve`` this test
starts on the embedded model as ``make serve`` does. The one change: the server listens on a free
port, so ``127.0.0.1:8000`` in a block becomes its address."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARK = "<!-- runnable -->"
DEFAULT_URL = "http://127.0.0.1:8000"
PREFIXKV = ROOT / ".venv" / "bin" / "prefixkv"  # what `make serve` runs and the README's shell uses


def runnable_blocks(markdown: str) -> list[tuple[str, str]]:
    """(language, code) of each fenced block that follows a ``<!-- runnable -->`` line."""
    blocks = []
    lines = markdown.split("\n")
    for i, line in enumerate(lines):
        if line.strip() != MARK:
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        m = re.match(r"```(\w+)\s*$", lines[j]) if j < len(lines) else None
        assert m, f"README.md:{i + 1}: {MARK} is not followed by a fenced block"
        end = lines.index("```", j + 1)
        blocks.append((m.group(1), "\n".join(lines[j + 1:end]) + "\n"))
    return blocks


def test_runnable_blocks_are_found_as_marked():
    md = f"text\n{MARK}\n\n```bash\necho hi\n```\n```python\nnot marked\n```\n{MARK}\n```python\nprint(1)\n```\n"
    assert runnable_blocks(md) == [("bash", "echo hi\n"), ("python", "print(1)\n")]
    with pytest.raises(AssertionError, match="not followed by a fenced block"):
        runnable_blocks(f"{MARK}\nprose\n")


@pytest.fixture(scope="module")
def server():
    if not PREFIXKV.exists():
        pytest.skip("no .venv/bin/prefixkv: `make test` makes it")
    proc = subprocess.Popen([str(PREFIXKV), "serve", "--host", "127.0.0.1", "--port", "0"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=os.environ.copy())
    try:
        url, deadline = None, time.monotonic() + 600  # a fresh cache converts the model first
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            m = re.match(r"prefixkv serving \S+ at (http://127\.0\.0\.1:\d+)$", line.strip())
            url = m.group(1) if m else None
        assert url, f"prefixkv serve did not come up (exit status {proc.poll()})"
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def test_the_readme_quick_start_works_as_written(server):
    blocks = runnable_blocks((ROOT / "README.md").read_text())
    assert [lang for lang, _ in blocks] == ["bash", "python", "python", "bash"]  # curl, openai, LLM, generate
    if shutil.which("curl") is None and any("curl " in code for _, code in blocks):
        pytest.skip("no curl on this machine")
    for lang, code in blocks:
        assert DEFAULT_URL in code or "prefixkv" in code, code
        code = code.replace(DEFAULT_URL, server)
        cmd = ["bash", "-e", "-o", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=os.environ.copy())
        assert res.returncode == 0, f"{lang} block failed:\n{code}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
        out = res.stdout.strip()
        if code.startswith("curl "):
            reply = json.loads(out)
            assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["content"].strip(), reply
        else:
            assert out, f"{lang} block printed nothing:\n{code}"
