"""``AsyncEngine``: an ``LLMEngine`` driven by one background thread, for asyncio servers.

::

    event loop(s)                                   engine thread (the only one that touches LLMEngine)
    -------------                                   -------------
    add_request / abort / run  --command queue-->   run commands, then engine.step()
    RequestStream (one pending output per request) <-- loop.call_soon_threadsafe(outputs of the step)

Because every ``LLMEngine`` call (add, abort, step, tokenizer work passed to ``run``) happens on the
engine thread, the engine needs no locks. The event loop never waits on a forward pass: it only waits
on its own queues. A stream whose consumer goes away (client disconnect: ``CancelledError`` /
``GeneratorExit``, or the stream is garbage-collected) aborts its request, which frees its KV blocks.

Back-pressure: a request's sink holds at most one undelivered output (prefixkv/streams.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from prefixkv.errors import EngineDeadError, EngineFatalError, RequestAbortedError, RequestFailedError
from prefixkv.outputs import RequestOutput
from prefixkv.sampling_params import SamplingParams
from prefixkv.streams import OutputSink, RequestStream, StreamingClient, deliver
from prefixkv.serve.load import queue_state

if TYPE_CHECKING:
    from prefixkv.config import EngineConfig
    from prefixkv.engine import LLMEngine, PromptType

logger = logging.getLogger(__name__)
T = TypeVar("T")

# When the engine has unfinished requests but a step schedules nothing, wait this long for commands
# before stepping again (no busy spin).
_IDLE_POLL_S = 0.005


class AsyncEngine(StreamingClient):
    """Owns an ``LLMEngine`` and runs its step loop on a background thread; an ``EngineClient``
    (prefixkv/engine_client.py).

    Use from coroutines on any event loop::

        engine = AsyncEngine(LLMEngine(config))
        async for out in engine.generate("req-1", "Hello", SamplingParams(max_tokens=8)):
            print(out.outputs[0].delta_text, end="")
        await engine.shutdown()
    """

    def __init__(self, engine: LLMEngine, thread_name: str = "prefixkv-engine") -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any] | None, concurrent.futures.Future]] = (
            queue.SimpleQueue())
        self._sinks: dict[str, OutputSink] = {}  # engine thread only
        self._stats: dict[str, Any] = engine.stats()  # replaced, never mutated, by the engine thread
        self._closing = False
        self._flushed = False  # the disk KV tier got the cached blocks at shutdown
        self._closed = threading.Event()
        self.fatal_error: BaseException | None = None  # the engine died of it (EngineFatalError)
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        from prefixkv.engine import LLMEngine

        return cls(LLMEngine(config))

    # ------------------------------------------------------------------ public API (event loop side)
    @property
    def is_running(self) -> bool:
        # fatal_error is set before the in-flight requests get their error, so a client that saw
        # its request fail with engine_dead never finds /health ok afterwards
        return not self._closing and self.fatal_error is None and self._thread.is_alive()

    # what the API layers read of an engine (prefixkv/engine_client.py's EngineClient)
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def info(self) -> Any:
        """``RuntimeInfo``: max_model_len, vocab_size, eos_token_ids, num_kv_blocks."""
        return self.engine.info

    @property
    def max_waiting_requests(self) -> int:
        return self.engine.config.scheduler.max_waiting_requests

    @property
    def default_sampling(self) -> dict[str, Any]:
        """The model's generation_config.json defaults for unset sampling fields."""
        return self.engine.default_sampling

    def compile_grammar(self, structured_outputs: Any) -> None:
        """Compile (and cache) a request's grammar; ValueError for a bad one. Thread-safe: called
        off the event loop before the request is added."""
        self.engine.grammars.compile(structured_outputs)

    def stats(self) -> dict[str, Any]:
        """``LLMEngine.stats()`` as of the engine thread's last step or command batch (no engine call)."""
        return dict(self._stats)

    async def cache_summary(self, max_nodes: int, text_tokens: int = 0) -> dict[str, Any]:
        """``LLMEngine.cache_summary``, computed on the engine thread between steps."""
        return await self.run(lambda e: e.cache_summary(max_nodes, text_tokens))

    async def routing_digest(self) -> tuple[dict[int, int], list[int]]:
        """``KVCacheCoordinator.routing_digest`` (block hash -> tier; the cached blocks retained
        now), for a router, on the engine thread between steps."""
        return await self.run(lambda e: e.scheduler.kv.routing_digest())

    async def kv_events_info(self) -> dict[str, Any] | None:
        """``LLMEngine.kv_events_info`` (where the KV events go, the hash algorithm)."""
        return await self.run(lambda e: e.kv_events_info())

    async def queue_state(self) -> dict[str, int]:
        """``serve.load.queue_state`` (the queues and the prompt tokens left to compute), between steps."""
        return await self.run(queue_state)

    async def release_retention(self, handle: str) -> bool:
        """``LLMEngine.release_retention``, on the engine thread between steps."""
        return await self.run(lambda e: e.release_retention(handle))

    async def reset_prefix_cache(self) -> bool:
        """``LLMEngine.reset_prefix_cache`` (False while requests run), on the engine thread between steps."""
        return await self.run(lambda e: e.reset_prefix_cache())

    async def run(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps; returns its result or raises its
        exception. Use it for tokenizer work (chat templates) so the tokenizer has one user."""
        return await asyncio.wrap_future(self._submit(lambda: fn(self.engine)))

    async def add_requests(self, requests: list[tuple[str, PromptType]], params: SamplingParams) -> list[RequestStream]:
        """Queue several requests in one engine command (so they enter the same step), all or none:
        if one is refused, those added before it are aborted and the error propagates. Raises what
        ``LLMEngine.add_request`` raises (``ValueError`` naming the field, ``OverflowError`` when the
        waiting queue is full), or ``EngineDeadError`` after shutdown. If this coroutine is
        cancelled, the requests are aborted whether or not the engine thread had already added them."""
        loop = asyncio.get_running_loop()
        sinks = [OutputSink(loop, params.output_kind == "delta") for _ in requests]

        def add_all() -> None:
            done = []
            try:
                for (rid, prompt), sink in zip(requests, sinks):
                    self._add(rid, prompt, params, sink)
                    done.append(rid)
            except BaseException:
                for rid in done:
                    self._sinks.pop(rid, None)
                    self.engine.abort(rid)
                raise

        fut = self._submit(add_all)
        try:
            await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            for (rid, _), sink in zip(requests, sinks):
                self._abort_sink(rid, sink)
            raise
        return [RequestStream(rid, sink, self._abort_sink) for (rid, _), sink in zip(requests, sinks)]

    async def abort(self, request_id: str) -> bool:
        """Abort a request; a consumer reading it gets ``RequestAbortedError``. False if unknown or done."""
        try:
            return await asyncio.wrap_future(self._submit(lambda: self._abort(request_id)))
        except EngineDeadError:
            return False

    async def start(self) -> None:
        """Nothing to do: the engine thread runs from the constructor on."""

    async def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the engine thread: in-flight requests are aborted and their consumers get
        ``EngineDeadError``. Waits (without blocking the event loop) for the thread to exit."""
        self._request_shutdown()
        await asyncio.get_running_loop().run_in_executor(None, self._join_and_flush, timeout)

    def close(self, timeout: float | None = 30.0) -> None:
        """Blocking ``shutdown`` for code without an event loop."""
        self._request_shutdown()
        self._join_and_flush(timeout)

    def _join_and_flush(self, timeout: float | None) -> None:
        """Once the engine thread has stopped: a disk KV tier gets every cached block (it
        survives the restart)."""
        self._thread.join(timeout)
        if not self._thread.is_alive() and not self._flushed:
            self._flushed = True
            self.engine.shutdown()

    # ------------------------------------------------------------------ plumbing
    def _submit(self, fn: Callable[[], Any] | None) -> concurrent.futures.Future:
        if self._closing:
            raise EngineDeadError("the engine is shut down")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, fut))
        if self._closed.is_set():  # lost the race with the thread's exit: nobody will run it
            self._fail_pending_commands()
        return fut

    def _abort_sink(self, request_id: str, sink: OutputSink) -> None:
        if self._closing:
            return
        self._commands.put((lambda: self._abort_if(request_id, sink), concurrent.futures.Future()))

    def _request_shutdown(self) -> None:
        if not self._closing:
            self._closing = True
            self._commands.put((None, concurrent.futures.Future()))

    # ------------------------------------------------------------------ engine thread
    def _add(self, request_id: str, prompt: PromptType, params: SamplingParams, sink: OutputSink) -> None:
        # LLMEngine.add_request rejects an id in use; every id in _sinks is one of its requests
        self.engine.add_request(request_id, prompt, params)
        self._sinks[request_id] = sink

    def _abort(self, request_id: str) -> bool:
        sink = self._sinks.pop(request_id, None)
        found = self.engine.abort(request_id)
        if sink is not None:
            deliver([(sink, RequestAbortedError(f"request {request_id!r} was aborted"))])
        return found

    def _abort_if(self, request_id: str, sink: OutputSink) -> None:
        """Abort only the request this sink belongs to (an id can be reused after it finished)."""
        if self._sinks.get(request_id) is sink:
            del self._sinks[request_id]
            self.engine.abort(request_id)

    def _run(self) -> None:
        try:
            while self._run_commands(block=not self.engine.has_unfinished()):
                if self.engine.has_unfinished():
                    num_steps = self.engine.num_steps
                    if not self._step():
                        break  # the engine is dead
                    if self.engine.num_steps == num_steps and self._commands.empty():
                        if not self._run_commands(block=True, timeout=_IDLE_POLL_S):
                            break  # shutdown arrived while idling
                self._stats = self.engine.stats()
        except BaseException:  # pragma: no cover - a bug in the loop itself
            logger.exception("engine thread crashed")
        finally:
            self._finish_all(EngineDeadError("the engine is shutting down"))
            self._closing = True
            self._fail_pending_commands()
            self._stats = self.engine.stats()
            self._closed.set()

    def _run_commands(self, block: bool, timeout: float | None = None) -> bool:
        """Run queued commands (waiting for the first one if ``block``). False once shutdown was asked."""
        try:
            item = self._commands.get(block=block, timeout=timeout)
        except queue.Empty:
            return True
        while True:
            fn, fut = item
            if fn is None:
                fut.set_result(None)
                return False
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # handed to the caller, re-raised there
                    fut.set_exception(e)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _step(self) -> bool:
        """One engine step; False if the engine died (every consumer got the error)."""
        try:
            outputs = self.engine.step()
        except EngineFatalError as e:
            logger.critical("the engine is dead (%s); ending the %d in-flight requests", e, len(self._sinks))
            self.fatal_error = e
            self._finish_all(e)
            return False
        except Exception as e:
            logger.exception("engine step failed; aborting the %d in-flight requests", len(self._sinks))
            self._finish_all(e)
            return True
        items = []
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if out.finished:
                del self._sinks[out.request_id]
            if out.error is not None:
                logger.error("request %s failed in the engine: %s", out.request_id, out.error)
                items.append((sink, RequestFailedError(out.error)))
            else:
                items.append((sink, out))
        deliver(items)
        return True

    def _finish_all(self, error: BaseException) -> None:
        """Abort every request we serve and hand ``error`` to its consumer."""
        items = []
        for request_id, sink in self._sinks.items():
            try:
                self.engine.abort(request_id)
            except Exception:  # pragma: no cover - keep aborting the rest
                logger.exception("abort of %s failed", request_id)
            items.append((sink, error))
        self._sinks.clear()
        deliver(items)

    def _fail_pending_commands(self) -> None:
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineDeadError("the engine is shut down"))
