"""What the first run does, said while it does it.

``Task(desc, total=None, unit=...)`` wraps work that can take more than a second or two: converting
a GGUF file, building the C kernels, loading weights, capturing CUDA graphs, an offline batch. On a
terminal (stderr a TTY) it is a tqdm bar, or a running clock where the total is unknown; otherwise
log lines: one when it starts (``announce``; else once it has run ``min_s``), one every ``every_s``
while it runs, one when it ends. The lines go to the "prefixkv" logger where the program
configured logging (``prefixkv serve`` does), else to stderr. Never to stdout.

Quiet: ``PREFIXKV_QUIET=1`` (what ``--quiet`` sets on the CLI), or the "prefixkv" logger's level
set above INFO (``logging.getLogger("prefixkv").setLevel(logging.WARNING)``).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

logger = logging.getLogger("prefixkv")


def quiet() -> bool:
    return os.environ.get("PREFIXKV_QUIET", "") not in ("", "0") or logger.level > logging.INFO


def _logging_configured() -> bool:
    return bool(logging.getLogger().handlers or logger.handlers)


def _say(message: str) -> None:
    if _logging_configured():
        logger.info(message)
    else:
        print(f"prefixkv: {message}", file=sys.stderr, flush=True)


class Task:
    """One piece of work: ``update(n)`` as items are done, ``close()`` (or leave the ``with``)."""

    def __init__(self, desc: str, total: int | None = None, unit: str = "it", announce: bool = True,
                 min_s: float = 1.0, every_s: float = 10.0) -> None:
        self.desc, self.total, self.unit = desc, total, unit
        self.n, self.postfix = 0, ""
        self.t0 = time.perf_counter()
        self.min_s, self.every_s = min_s, every_s
        self.bar = None
        self.logged = False  # off a terminal: a line went out
        self._stop = threading.Event()
        self._clock: threading.Thread | None = None
        if quiet():
            return
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, delay=0.0 if announce else min_s, file=sys.stderr,
                            dynamic_ncols=True, bar_format=None if total else "{desc}: {elapsed}")
        elif announce:
            self._log(f"{desc}{f' ({total} {unit})' if total else ''} ...")
        self._clock = threading.Thread(target=self._tick, name="prefixkv-progress", daemon=True)
        self._clock.start()

    def _tick(self) -> None:
        """On a terminal: redraw the bar (tqdm redraws only when told: a clock while nothing counts).
        Off one: the first line once the work has run ``min_s``, then one every ``every_s``."""
        next_line = self.every_s if self.logged else self.min_s  # (an announced task said so at its start)
        while not self._stop.wait(0.5):
            if self.bar is not None:
                self.bar.refresh()
                continue
            elapsed = time.perf_counter() - self.t0
            if elapsed >= next_line:
                count = f"{self.n}{f'/{self.total}' if self.total else ''} {self.unit}, " if self.n else ""
                self._log(f"{self.desc}: {count}{f'{self.postfix}, ' if self.postfix else ''}{elapsed:.0f} s")
                next_line = elapsed + self.every_s

    def _log(self, message: str) -> None:
        self.logged = True
        _say(message)

    def set_total(self, total: int) -> None:
        self.total = total
        if self.bar is not None:
            self.bar.total, self.bar.bar_format = total, None  # (a clock until now)
            self.bar.refresh()

    def update(self, n: int = 1, postfix: str | None = None) -> None:
        self.n += n
        if postfix is not None:
            self.postfix = postfix
        if self.bar is not None:
            if postfix is not None:
                self.bar.set_postfix_str(postfix, refresh=False)
            self.bar.update(n)

    def close(self, failed: bool = False) -> None:
        self._stop.set()
        if self._clock is not None:
            self._clock.join()
        if self.bar is not None:
            self.bar.close()
        elif self.logged:
            self._log(f"{self.desc}: {'failed after' if failed else 'done in'} {time.perf_counter() - self.t0:.1f} s")

    def __enter__(self) -> "Task":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failed=exc_type is not None)
