"""Client side of a local ``prefixkv serve``, shared by ``bench serving`` and ``tools/loadtest``.

Loopback URLs only; a spawned server runs this checkout's prefixkv on 127.0.0.1 with a free port.
Standard library and aiohttp only (imported when first used), so the load tool needs no torch.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

METRIC_LINE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$")
ROOT = Path(__file__).resolve().parent.parent


def check_loopback(url: str, prog: str) -> str:
    """``http://<loopback>:PORT`` -> its base URL; anything else is refused (``SystemExit``)."""
    u = urllib.parse.urlsplit(url)
    host = u.hostname or ""
    ok = host == "localhost"
    if not ok:
        try:
            ok = ipaddress.ip_address(host).is_loopback
        except ValueError:
            ok = False
    if u.scheme != "http" or not ok or u.port is None:
        raise SystemExit(f"{prog}: --url must be http://<loopback address>:PORT "
                         f"(127.0.0.1, ::1, localhost), got {url!r}")
    return f"http://{u.netloc}"


class SpawnedServer:
    """``prefixkv serve`` on 127.0.0.1, port 0 (a free one), prefixkv imported from this checkout;
    its stderr goes to ``log`` (default: a temp file). ``serve_args`` follow ``--port 0``."""

    def __init__(self, serve_args: list[str], prog: str, log: str | None = None, api_key: str | None = None,
                 python: str = sys.executable) -> None:
        self.prog = prog
        self.cmd = [python, "-m", "prefixkv.cli", "serve", "--host", "127.0.0.1", "--port", "0", *serve_args]
        if log:
            self.log_path = Path(log)
        else:
            fd, name = tempfile.mkstemp(prefix=f"prefixkv-{prog.replace(' ', '-')}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self._log = open(self.log_path, "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if api_key:
            env["PREFIXKV_API_KEY"] = api_key
        env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env)
        self.url: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read_stdout, daemon=True).start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            m = re.match(r"prefixkv serving .* at (http://127\.0\.0\.1:\d+)$", line.strip())
            if m and self.url is None:
                self.url = m.group(1)
                self._ready.set()
        self._ready.set()  # the process exited

    def wait_ready(self, timeout_s: float) -> str:
        """The server's base URL once it listens; ``SystemExit`` with the log's tail if it does not."""
        if not self._ready.wait(timeout_s) or self.url is None:
            code = self.proc.poll()
            why = f"exited with code {code}" if code is not None else f"did not start within {timeout_s:.0f} s"
            self.stop()
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise SystemExit(f"{self.prog}: the server {why} ({' '.join(self.cmd)}); log tail:\n{tail}")
        return self.url

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM (SIGKILL after ``timeout_s``); the exit code, None if it had to be killed."""
        killed = False
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                killed = True
        self._log.close()
        return None if killed else self.proc.returncode

    def log_findings(self) -> dict[str, object]:
        text = self.log_path.read_text(errors="replace")
        tracebacks = [m.start() for m in re.finditer(r"^Traceback", text, re.M)]
        first = text[tracebacks[0]:tracebacks[0] + 1500] if tracebacks else None
        return {"server_log": str(self.log_path), "server_tracebacks": len(tracebacks),
                "server_error_lines": len(re.findall(r" ERROR ", text)), "first_traceback": first}


async def wait_health(session, base: str, timeout_s: float, prog: str) -> None:
    import aiohttp

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            async with session.get(base + "/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                if resp.status == 200:
                    return
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{prog}: {base}/health did not answer 200 within {timeout_s:.0f} s")
        await asyncio.sleep(0.2)


async def scrape(session, base: str) -> dict[str, float]:
    """/metrics as {name{labels}: value}; {} if the server does not answer with them."""
    import aiohttp

    try:
        async with session.get(base + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            if resp.status != 200:
                return {}
            text = await resp.text()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return {}
    out = {}
    for line in text.splitlines():
        m = METRIC_LINE.match(line)
        if m:
            try:
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
            except ValueError:
                pass
    return out


def _idle(metrics: dict[str, float]) -> bool:
    return (metrics.get("prefixkv_num_requests_running", 1) == 0
            and metrics.get("prefixkv_num_requests_waiting", 1) == 0)


async def drain(session, base: str, timeout_s: float) -> tuple[bool, dict[str, float], float]:
    """Wait until no request is running or waiting; returns (drained, last scrape, seconds waited)."""
    t0 = time.monotonic()
    while True:
        metrics = await scrape(session, base)
        if _idle(metrics):
            # one more scrape: aborts queued on the engine thread land between two snapshots
            await asyncio.sleep(0.2)
            metrics = await scrape(session, base)
            if _idle(metrics):
                return True, metrics, time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            return False, metrics, time.monotonic() - t0
        await asyncio.sleep(0.2)


class SSEEvents:
    """The JSON events of an OpenAI-style SSE body (``data: {json}`` lines) up to ``data: [DONE]``,
    after which ``done`` is True; a body that ends without it leaves ``done`` False. A malformed
    event raises ``ValueError``."""

    def __init__(self, content) -> None:
        self.content = content  # aiohttp's resp.content
        self.done = False

    async def __aiter__(self):
        async for line in self.content:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                self.done = True
                return
            yield json.loads(data)
