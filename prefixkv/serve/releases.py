"""Retentions released at the ingress, for every engine replica to release.

A stored Response's prefix is retained under the response's id on whichever replica served it
(``SamplingParams.kv_retention_handle``); the ingress cannot tell which one, nor call a chosen
replica through Serve's router. So a deleted (or dropped) stored response's id goes into one log,
a named Ray actor of the application that the ingress creates at its first release (owned by that
ingress replica); every replica reads what is new in it each routing-stats period
(``EngineReplica.release_logged``) and releases in its engine the handles its own requests named
(a request still running when its handle comes is released again when it ends). A release takes
effect within a period of the replica's next look; the first one also waits for the log to start
and be found (looked up every few periods). The single-process server releases before the DELETE
is answered.

The log keeps the last ``keep`` handles. A replica that started after a handle was logged reads
what the log keeps (none of it named by its requests); a log created again (its owner gone) has
another ``log_id``, and the replicas start over on it.
"""

from __future__ import annotations

import collections
import itertools
import uuid


class ReleaseLog:
    """The Ray actor's class (``ray.remote(ReleaseLog)``): handles in the order they were released."""

    def __init__(self, keep: int = 1 << 16) -> None:
        self.log_id = uuid.uuid4().hex
        self._handles: collections.deque[str] = collections.deque(maxlen=keep)
        self._next = 0  # the position the next handle gets

    def append(self, handles: list[str]) -> int:
        """Log ``handles``; returns the position after the last one."""
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


def log_name(app_name: str) -> str:
    """The named actor of ``app_name``'s release log."""
    return f"prefixkv-releases-{app_name}"
