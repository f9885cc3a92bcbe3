"""Engine errors shared by the engine, its clients and the server (no torch)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine serves no more requests: it was shut down, or it died (``EngineFatalError``)."""


class EngineFatalError(EngineDeadError):
    """A step failed in a way that leaves the device unusable (a CUDA error, out of memory), or the
    engine-core process died: every request was aborted and the engine refuses further work. A
    server reports it on ``/health`` (503) and exits non-zero so that its supervisor restarts it."""


class ReplicaDiedError(RuntimeError):
    """The engine replica serving a request died (Ray Serve restarts it); the request ended there.
    Requests not yet started on it are routed elsewhere."""


class RequestAbortedError(RuntimeError):
    """The request was aborted (``abort``) while a consumer was reading it."""


class RequestFailedError(RuntimeError):
    """A step failed for this request (its blocks are freed; other requests went on)."""
