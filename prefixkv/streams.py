"""Request streams of the asyncio engine clients (``AsyncEngine``, ``EngineCoreClient``): where a
request's outputs are handed over to its consumer, whatever thread or event loop produced them.

::

    producer (engine thread, or the client's socket reader)       consumer (any event loop)
    deliver([(sink, output | error), ...])  --call_soon_threadsafe-->  OutputSink.put -> RequestStream

Back-pressure: a sink holds at most one undelivered output. A consumer slower than the engine gets
the deltas of several steps merged into one (``merge_outputs``), so its memory grows with the
undelivered tokens only, never with the number of steps, and it writes once per wake-up.

A consumer that can handle an output without awaiting (the server writing a streamed delta to its
socket) sets ``RequestStream.on_output``: while it waits for the next output, with nothing pending,
``put`` offers each output to that callback first, and an output it takes never wakes the
consumer's task (at 64 streams, 64 task wake-ups a step fewer).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from prefixkv.outputs import RequestOutput, merge_outputs

if TYPE_CHECKING:
    from prefixkv.engine_client import PromptType
    from prefixkv.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class OutputSink:
    """One request's pending output (later ones merged into it) or error, and an event to wake the
    consumer. Read and written on ``loop`` only (``deliver`` hands items over)."""

    __slots__ = ("loop", "pending", "error", "ready", "delta", "waiting", "on_output", "on_output_failed")

    def __init__(self, loop: asyncio.AbstractEventLoop, delta: bool) -> None:
        self.loop = loop
        self.pending: RequestOutput | None = None
        self.error: BaseException | None = None
        self.ready = asyncio.Event()
        self.delta = delta  # the request's outputs carry deltas (output_kind "delta")
        self.waiting = False  # the consumer is parked in ``get``: all it took before is handled
        self.on_output: Callable[[RequestOutput], bool] | None = None
        self.on_output_failed = False  # ``error`` is on_output's: the engine still runs the request

    def put(self, item: RequestOutput | BaseException) -> None:
        # offered only while the consumer waits with nothing pending, so that outputs stay in order
        if (self.on_output is not None and self.waiting and self.pending is None and self.error is None
                and not isinstance(item, BaseException) and not item.finished):
            try:
                if self.on_output(item):
                    return
            except Exception as e:  # it may have sent part of the output: the stream ends with the error
                logger.exception("a stream's on_output failed; the stream ends with its error")
                self.on_output = None
                self.on_output_failed = True
                item = e
        if isinstance(item, BaseException):
            self.error = self.error or item
        elif self.pending is None:
            self.pending = item
        else:
            self.pending = merge_outputs(self.pending, item, self.delta)
        self.ready.set()

    async def get(self) -> RequestOutput | BaseException:
        while self.pending is None and self.error is None:
            self.ready.clear()
            self.waiting = True
            try:
                await self.ready.wait()
            finally:
                self.waiting = False
        if self.pending is not None:  # outputs delivered before an error still reach the consumer
            item, self.pending = self.pending, None
            return item
        return self.error


class RequestStream:
    """Async iterator over one request's ``RequestOutput`` deltas; the last one has ``finished``
    (an ``OutputStream``, prefixkv/engine_client.py).

    Leaving it early (``abort()``, ``async with`` exit, garbage collection) calls ``on_abort(request_id,
    sink)``, which aborts the request in the engine. Errors delivered by the producer
    (``EngineDeadError``, ``RequestAbortedError``, a step's failure) are raised from ``__anext__``.
    """

    def __init__(self, request_id: str, sink: OutputSink, on_abort: Callable[[str, OutputSink], None]) -> None:
        self.request_id = request_id
        self._sink = sink
        self._on_abort = on_abort
        self._done = False

    @property
    def done(self) -> bool:
        return self._done

    @property
    def on_output(self) -> Callable[[RequestOutput], bool] | None:
        """Called on the consumer's event loop with each output that arrives while the consumer
        waits in ``__anext__`` with nothing pending; never with an error or the finished output
        (the stream ends when ``__anext__`` returns that). True: it took the output, which
        ``__anext__`` will not return. False: ``__anext__`` returns it, as without a callback. If
        it raises, ``__anext__`` raises that error instead of returning the output (which it may have
        sent in part) and aborts the request, and the callback is dropped."""
        return self._sink.on_output

    @on_output.setter
    def on_output(self, fn: Callable[[RequestOutput], bool] | None) -> None:
        self._sink.on_output = fn

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._sink.get()
        if isinstance(item, BaseException):
            if self._sink.on_output_failed:  # not the engine's error: the request is still running there
                self.abort()
            self._done = True
            raise item
        if item.finished:
            self._done = True
        return item

    def abort(self) -> None:
        """Abort the request unless it already finished. Never raises; safe from any thread."""
        if not self._done:
            self._done = True
            self._on_abort(self.request_id, self._sink)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.abort()

    def __del__(self) -> None:
        self.abort()


def _put_all(items: list[tuple[OutputSink, Any]]) -> None:
    for sink, item in items:
        sink.put(item)


def deliver(items: list[tuple[OutputSink, RequestOutput | BaseException]],
            here: asyncio.AbstractEventLoop | None = None) -> None:
    """Hand items to their sinks: at once for sinks of ``here`` (the running loop of the caller, if
    it has one), one ``call_soon_threadsafe`` per other event loop."""
    batches: dict[asyncio.AbstractEventLoop, list[tuple[OutputSink, Any]]] = {}
    for sink, item in items:
        if sink.loop is here:
            sink.put(item)
        else:
            batches.setdefault(sink.loop, []).append((sink, item))
    for loop, batch in batches.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # that event loop is closed: nobody is listening
            pass


class StreamingClient:
    """``add_request`` and ``generate`` on top of a client's ``add_requests``."""

    async def add_requests(self, requests: list[tuple[str, PromptType]],
                           params: SamplingParams) -> list[RequestStream]:
        raise NotImplementedError

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams) -> RequestStream:
        """Queue one request and return the stream of its outputs (errors as ``add_requests``)."""
        return (await self.add_requests([(request_id, prompt)], params))[0]

    async def generate(self, request_id: str, prompt: PromptType,
                       params: SamplingParams | None = None) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs; errors from ``add_request`` propagate unchanged. If the
        consumer stops early (``aclose``, ``CancelledError``, ``GeneratorExit``) the request is aborted."""
        from prefixkv.sampling_params import SamplingParams

        stream = await self.add_request(request_id, prompt, params or SamplingParams())
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()
