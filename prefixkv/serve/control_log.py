"""What the ingress asks of every engine replica: retentions to release, prefix-cache resets to do.

The ingress cannot tell which replica served a request, nor call a chosen replica through Serve's
router. So it writes what it asks into one log, a named Ray actor of the application that the
ingress creates when it starts (owned by that ingress replica; no CPU of its own); every replica
reads what is new in it each routing-stats period (``EngineReplica.release_logged`` and
``reset_logged``). The first look also waits for the log to start and be found (looked up every
few periods).

Releases. A stored Response's prefix is retained under the response's id on whichever replica
served it (``SamplingParams.kv_retention_handle``). A deleted (or dropped) stored response's id is
appended; each replica releases in its engine the handles its own requests named (a request still
running when its handle comes is released again when it ends). The log keeps the last ``keep``
handles: a replica that started after a handle was logged reads what the log keeps (none of it
named by its requests).

Resets (``POST /reset_prefix_cache``). The ingress asks one, numbered, of the replicas its router
knows; each of them resets its engine's cache (refused while a request runs or waits there, as the
engine refuses) and reports the outcome under its replica id, and the ingress waits for their
reports. A replica the reset does not name (one started since) leaves it. The last
``keep_resets`` resets and their reports are kept.

A log created again (its owner gone) has another ``log_id``, and the replicas start over on it.
"""

from __future__ import annotations

import collections
import itertools
import uuid


class ControlLog:
    """The Ray actor's class (``ray.remote(ControlLog)``)."""

    def __init__(self, keep: int = 1 << 16, keep_resets: int = 64) -> None:
        self.log_id = uuid.uuid4().hex
        self._handles: collections.deque[str] = collections.deque(maxlen=keep)
        self._next = 0  # the position the next handle gets
        self._keep_resets = keep_resets
        # reset number -> (the replicas asked, their reports: replica id -> reset or refused)
        self._resets: collections.OrderedDict[int, tuple[frozenset[str], dict[str, bool]]] = collections.OrderedDict()
        self._next_reset = 0  # the number the next reset gets

    # ------------------------------------------------------------------ releases
    def append(self, handles: list[str]) -> int:
        """Log ``handles`` to release; returns the position after the last one."""
        self._handles.extend(handles)
        self._next += len(handles)
        return self._next

    def since(self, log_id: str | None, position: int) -> tuple[str, int, list[str]]:
        """(this log's id, the position after its last handle, the handles from ``position`` on)
        for a reader that has read up to ``position`` of the log ``log_id`` (another log, or None:
        every handle kept)."""
        first = self._next - len(self._handles)
        start = position if log_id == self.log_id else 0
        return self.log_id, self._next, list(itertools.islice(self._handles, max(0, start - first), None))

    # ------------------------------------------------------------------ resets
    def ask_reset(self, replica_ids: list[str]) -> tuple[str, int]:
        """Ask replicas ``replica_ids`` to reset their prefix caches; returns (this log's id, the
        reset's number)."""
        number = self._next_reset
        self._next_reset += 1
        self._resets[number] = (frozenset(replica_ids), {})
        while len(self._resets) > self._keep_resets:
            self._resets.popitem(last=False)
        return self.log_id, number

    def resets_since(self, log_id: str | None, number: int, replica_id: str) -> tuple[str, int, list[int]]:
        """(this log's id, the number the next reset gets, the kept resets numbered from ``number``
        on that name ``replica_id``) for that replica, which has read up to ``number`` of the log
        ``log_id`` (another log, or None: from the start)."""
        start = number if log_id == self.log_id else 0
        return self.log_id, self._next_reset, [n for n, (asked, _) in self._resets.items()
                                               if n >= start and replica_id in asked]

    def report_reset(self, number: int, replica_id: str, done: bool) -> None:
        """Replica ``replica_id``'s outcome of reset ``number``: True reset, False refused."""
        if number in self._resets:
            self._resets[number][1][replica_id] = done

    def reset_reports(self, log_id: str, number: int) -> dict[str, bool] | None:
        """replica id -> its outcome, for the replicas that have reported reset ``number`` of the
        log ``log_id``; None if this is another log (the one asked is gone) or the reset is no
        longer kept."""
        entry = self._resets.get(number) if log_id == self.log_id else None
        return dict(entry[1]) if entry is not None else None


def log_name(app_name: str) -> str:
    """The named actor of ``app_name``'s control log."""
    return f"prefixkv-control-{app_name}"
