"""``EngineCoreClient``: an ``EngineClient`` (prefixkv/engine_client.py) whose engine steps in the
engine-core process (engine_core/core.py), and ``CoreProcess``, that process started from here.

::

    consumer loops                  home event loop (the server's)                engine core
    --------------                  ------------------------------                -----------
    add_requests -------------->    AddRequests(call_id) ------------------->     queue (or refuse)
                                    <------------------------------------------   Reply(call_id)
    RequestStream <- deliver <--    _read: StepOutputs -> text stage  <-------    StepOutputs per step
    stream.abort() ------------>    Abort (batched per loop pass) ---------->     engine.abort

The client does the textual half of output processing that the core leaves out: each request's
samples are mirrored here as ``Request``s holding their token ids, and the engine's own
``OutputProcessor`` detokenizes them, applies the stop strings (a stop string that ends a request
here aborts it in the core), holds back a possible stop string's start and builds the
``RequestOutput``s: the same code on the same tokens as in one process, so the same outputs.

Messages that arrive together are handled together: a request whose outputs of several steps
wait is processed once, with their tokens joined (a slow front end catches up by coalescing; it
never makes the core wait). The socket lives on one event loop (the first one to use the client,
rebound if that loop has closed); calls from other loops go through it, streams deliver to each
consumer's own loop.

The engine core ending -- it died, was killed, or sent ``Dead``, or a message from it cannot be
decoded -- makes ``fatal_error`` an ``EngineFatalError``: every in-flight request ends with it,
``is_running`` turns False (/health 503) and ``serve()`` exits with status 1.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import tempfile
import time
import uuid
from array import array
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import zmq
import zmq.asyncio

from prefixkv.config import RuntimeInfo
from prefixkv.engine_core import messages as m
from prefixkv.engine_core.core import CoreFacts, run_engine_core
from prefixkv.engine_core.process import engine_environment, is_alive, watch_exit
from prefixkv.errors import EngineDeadError, EngineFatalError, RequestAbortedError, RequestFailedError
from prefixkv.output_processor import OutputProcessor, RequestState
from prefixkv.outputs import RequestOutput
from prefixkv.request import Request, RequestStatus
from prefixkv.sampling_params import SamplingParams
from prefixkv.streams import OutputSink, RequestStream, StreamingClient, deliver

if TYPE_CHECKING:
    from prefixkv.config import EngineConfig
    from prefixkv.engine import LLMEngine
    from prefixkv.engine_client import PromptType
    from prefixkv.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_ERRORS = {"invalid": ValueError, "overloaded": OverflowError}
STARTUP_TIMEOUT_S = 1800.0  # a first start may convert a GGUF or compile the kernels


class CoreProcess:
    """The engine-core process, started (``multiprocessing`` spawn) with ``engine_config``.
    ``wait_ready()`` returns once the engine is loaded (``facts``) or raises what loading raised
    (``ValueError`` / ``FileNotFoundError`` as such, anything else as ``RuntimeError``); the
    constructor waits too unless ``wait=False``. ``make_engine`` (a module-level callable: it is
    pickled) builds the engine instead of ``LLMEngine`` (tests inject faults with it); ``threads``
    sets its torch threads."""

    def __init__(self, engine_config: EngineConfig, threads: int | None = None,
                 make_engine: Callable[[EngineConfig], LLMEngine] | None = None, wait: bool = True) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.address = f"ipc://{tempfile.gettempdir()}/prefixkv-core-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._reader, writer = ctx.Pipe(duplex=False)
        # daemon: an interpreter that exits without stopping it (an exception, sys.exit during the
        # load) terminates it on the way out (SIGTERM: it still flushes the disk tier)
        self.process = ctx.Process(target=run_engine_core, name="prefixkv-engine-core", daemon=True,
                                   args=(engine_config, self.address, writer, os.getpid(), threads, make_engine))
        env = engine_environment()
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # what the spawned interpreter starts with
        try:
            self.process.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        writer.close()
        self.facts: CoreFacts | None = None
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> CoreFacts:
        if self.facts is None:
            try:
                self.facts = self._wait_ready(self._reader, timeout_s)
            except BaseException:
                self.stop(5.0)
                raise
            finally:
                self._reader.close()
        return self.facts

    def _wait_ready(self, reader, timeout_s: float) -> CoreFacts:
        deadline = time.monotonic() + timeout_s
        while not reader.poll(0.1):
            if not self.process.is_alive():
                raise RuntimeError(f"the engine core exited with status {self.process.exitcode} while it loaded")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine core did not start within {timeout_s:.0f} s")
        try:
            msg = reader.recv()
        except EOFError:
            self.process.join(5.0)
            raise RuntimeError(f"the engine core exited with status {self.process.exitcode} while it loaded") from None
        if msg[0] == "error":
            _, kind, text = msg
            raise {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError}.get(kind, RuntimeError)(text)
        return msg[1]

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """Wait for it to end (it was asked to); SIGTERM if it does not, SIGKILL as a last resort.
        Returns its exit status."""
        p = self.process
        p.join(timeout_s)
        if p.is_alive():
            logger.warning("the engine core did not stop within %.0f s; terminating it", timeout_s)
            p.terminate()
            p.join(timeout_s)
        if p.is_alive():
            p.kill()
            p.join()
        return p.exitcode


class _Tracked:
    """A request of this client: its output state and where its outputs go."""

    __slots__ = ("group", "sink")

    def __init__(self, group: RequestState, sink: OutputSink) -> None:
        self.group = group
        self.sink = sink


class EngineCoreClient(StreamingClient):
    """An ``EngineClient`` over the engine-core process at ``address`` (see the module docstring).

    ``launch(config)`` starts a core and owns it (``shutdown`` stops it); a client built from an
    address and the core's ``facts`` shares a core another process owns (``--api-server-count``).
    """

    def __init__(self, address: str, facts: CoreFacts, tokenizer: Tokenizer | None = None,
                 process: CoreProcess | None = None) -> None:
        if tokenizer is None:
            from prefixkv.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_pretrained(facts.model_path)
        self.address = address
        self.facts = facts
        self.tokenizer = tokenizer
        self.info = RuntimeInfo(num_kv_blocks=facts.num_kv_blocks, max_model_len=facts.max_model_len,
                                eos_token_ids=list(facts.eos_token_ids), vocab_size=facts.vocab_size)
        self.max_waiting_requests = facts.max_waiting_requests
        self.default_sampling = dict(facts.default_sampling)
        self.fatal_error: BaseException | None = None
        self.output = OutputProcessor(tokenizer, self.info.eos_token_ids, self.info.max_model_len)
        self._process = process
        self._stats: dict[str, Any] = dict(facts.stats)
        self._grammars = None
        self._closing = False
        self._shutdown_sent = False
        self._exited = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._pidfd: int | None = None
        self._requests: dict[str, _Tracked] = {}  # home loop only
        self._calls: dict[int, asyncio.Future] = {}  # home loop only
        self._call_ids = itertools.count()
        self._aborts: list[str] = []
        self._encoder = msgspec.msgpack.Encoder()

    @classmethod
    def launch(cls, engine_config: EngineConfig, threads: int | None = None,
               make_engine: Callable[[EngineConfig], LLMEngine] | None = None) -> EngineCoreClient:
        """Start an engine core for ``engine_config`` and return its (owning) client. A model
        directory's tokenizer loads here while the core loads the model."""
        from prefixkv.tokenizer import Tokenizer

        process = CoreProcess(engine_config, threads, make_engine, wait=False)
        try:
            model = engine_config.model
            tokenizer = None
            if model is not None and os.path.isdir(os.path.expanduser(model)):
                try:
                    tokenizer = Tokenizer.from_pretrained(os.path.expanduser(model))
                except Exception:  # the core's own error about this model, if it has one, says more
                    process.wait_ready()
                    raise
            return cls(process.address, process.wait_ready(), tokenizer, process=process)
        except BaseException:
            process.process.terminate()
            process.stop(10.0)
            raise

    # ------------------------------------------------------------------ EngineClient
    @property
    def pid(self) -> int:
        """The engine core's process id."""
        return self.facts.pid

    @property
    def is_running(self) -> bool:
        return not self._closing and self.fatal_error is None and not self._exited and is_alive(self.facts.pid)

    def compile_grammar(self, structured_outputs: Any) -> None:
        """Validates here (a 400 before the request leaves); the core compiles it into its own cache."""
        if self._grammars is None:
            from prefixkv.structured_outputs import GrammarCompiler

            self._grammars = GrammarCompiler(self.tokenizer, self.info.vocab_size)
        self._grammars.compile(structured_outputs)

    def stats(self) -> dict[str, Any]:
        """The engine's statistics as the core last published them (every 0.1 s while it steps,
        and when it goes idle)."""
        return dict(self._stats)

    async def cache_summary(self, max_nodes: int, text_tokens: int = 0) -> dict[str, Any]:
        return await self.call("cache_summary", max_nodes, text_tokens)

    async def routing_digest(self) -> tuple[dict[int, int], list[int]]:
        """``KVCacheCoordinator.routing_digest`` (block hash -> tier; the cached blocks retained
        now), for a router, between steps."""
        digest, retained = await self.call("routing_digest")
        return digest, retained

    async def kv_events_info(self) -> dict[str, Any] | None:
        """``LLMEngine.kv_events_info`` (where the KV events go, the hash algorithm)."""
        return await self.call("kv_events_info")

    async def queue_state(self) -> dict[str, int]:
        """``serve.load.queue_state`` (the queues and the prompt tokens left to compute), between steps."""
        return await self.call("queue_state")

    async def release_retention(self, handle: str) -> bool:
        """``LLMEngine.release_retention``, between steps."""
        return await self.call("release_retention", handle)

    async def reset_prefix_cache(self) -> bool:
        """``LLMEngine.reset_prefix_cache`` (False while requests run), between steps."""
        return await self.call("reset_prefix_cache")

    async def start(self) -> None:
        """Open the socket on the running loop (the server's) and watch the core's process from it."""
        await self._on_home(self._started)

    async def _started(self) -> None:
        self._check_alive()

    async def add_requests(self, requests: list[tuple[str, PromptType]],
                           params: SamplingParams) -> list[RequestStream]:
        """Queue the requests in one message (they enter the same step), all or none; raises
        ``ValueError`` (naming the field), ``OverflowError`` (queue full) or ``EngineDeadError``. A
        text prompt is tokenized here. If this coroutine is cancelled, the requests are aborted."""
        self._check_alive()
        prompts = [(rid, self._prompt(p)) for rid, p in requests]
        loop = asyncio.get_running_loop()
        sinks = [OutputSink(loop, params.output_kind == "delta") for _ in requests]
        await self._on_home(self._add, prompts, params, sinks)
        return [RequestStream(rid, sink, self._abort_sink) for (rid, _), sink in zip(requests, sinks)]

    async def abort(self, request_id: str) -> bool:
        """Abort a request; a consumer reading it gets ``RequestAbortedError``. False if unknown or done."""
        if self._loop is None:
            return False
        return await self._on_home(self._abort_now, request_id)

    async def call(self, method: str, *args: Any) -> Any:
        """A utility of the core (``core.UTILITIES``: cache_summary, routing_digest, queue_state,
        kv_events_info, check_integrity, stats, reset_prefix_cache, release_retention), run between
        two steps; its error is raised here."""
        self._check_alive()
        return await self._on_home(self._call, method, list(args))

    async def shutdown(self, timeout: float = 30.0) -> None:
        """In-flight requests end with ``EngineDeadError``; an owned core aborts them, writes the
        disk tier and exits (waited for without blocking the event loop)."""
        await self._on_home(self._close_home)
        if self._process is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._stop_process, timeout)

    def close(self, timeout: float = 30.0) -> None:
        """``shutdown`` for code without an event loop (or from another thread than the home loop's)."""
        loop = self._loop
        if loop is not None and loop.is_running():
            asyncio.run_coroutine_threadsafe(self._close_home(), loop).result(timeout)
        elif not self._closing:  # the socket's loop has ended: close it here (an owned core gets SIGTERM)
            self._closing = True
            self._end_all(EngineDeadError("the engine is shutting down"))
            self._unbind()
            if self._ctx is not None:
                self._ctx.term()
                self._ctx = None
        if self._process is not None:
            self._stop_process(timeout)

    # ------------------------------------------------------------------ the home loop
    async def _on_home(self, fn, *args):
        loop = asyncio.get_running_loop()
        home = self._loop
        if home is None or home.is_closed() or (home is not loop and not home.is_running()):
            self._bind(loop)
            home = loop
        if home is loop:
            return await fn(*args)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(fn(*args), home))

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Open the socket on ``loop`` (again, if the loop it lived on has ended: the requests of
        that loop are gone with it)."""
        if self._socket is not None:
            self._unbind()
        self._loop = loop
        self._ctx = self._ctx or zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(self.address)
        self._socket = sock
        self._send(m.Hello())
        self._reader = loop.create_task(self._read())
        self._pidfd = watch_exit(self.facts.pid)
        if self._pidfd is not None:
            loop.add_reader(self._pidfd, self._core_exited)
        else:
            loop.call_later(0.5, self._poll_core)

    def _unbind(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        if self._pidfd is not None:
            try:
                if self._loop is not None and not self._loop.is_closed():
                    self._loop.remove_reader(self._pidfd)
            except (RuntimeError, ValueError):
                pass
            os.close(self._pidfd)
            self._pidfd = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        self._requests.clear()
        self._calls.clear()

    def _send(self, msg: Any) -> None:
        self._socket.send(self._encoder.encode(msg))

    def _prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt; the core checks the ids (range, length, room in the cache)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    async def _add(self, prompts: list[tuple[str, tuple[str | None, list[int]]]], params: SamplingParams,
                   sinks: list[OutputSink]) -> None:
        self._check_alive()
        wire = m.params_to_wire(m.core_params(params))
        for (rid, (text, ids)), sink in zip(prompts, sinks):
            if rid in self._requests:
                raise ValueError(f"request_id: {rid!r} is already in use")
            group = RequestState(rid, text, array("q", ids), params)
            if params.prompt_logprobs is not None:
                group.prompt_logprobs = []
            group.seqs[0] = self._sample(group, 0)
            self._requests[rid] = _Tracked(group, sink)
        rids = [rid for rid, _ in prompts]
        try:
            await self._roundtrip(lambda call_id: m.AddRequests(call_id, [(rid, ids) for rid, (_, ids) in prompts],
                                                                 wire))
        except BaseException as e:
            for rid, sink in zip(rids, sinks):
                t = self._requests.get(rid)
                if t is not None and t.sink is sink:
                    del self._requests[rid]
            if isinstance(e, asyncio.CancelledError):  # the core may have queued them meanwhile
                self._queue_aborts(rids)
            raise

    async def _call(self, method: str, args: list[Any]) -> Any:
        self._check_alive()
        return await self._roundtrip(lambda call_id: m.Call(call_id, method, args))

    async def _roundtrip(self, make: Callable[[int], Any]) -> Any:
        call_id = next(self._call_ids)
        future = self._loop.create_future()
        self._calls[call_id] = future
        try:
            self._send(make(call_id))
            return await future
        finally:
            self._calls.pop(call_id, None)

    async def _abort_now(self, request_id: str) -> bool:
        t = self._requests.pop(request_id, None)
        if t is None:
            return False
        self._queue_aborts([request_id])
        deliver([(t.sink, RequestAbortedError(f"request {request_id!r} was aborted"))], self._loop)
        return True

    def _abort_sink(self, request_id: str, sink: OutputSink) -> None:
        """A stream was left early (any thread)."""
        loop = self._loop
        if loop is None or self._closing:
            return
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is loop:
            self._abort_if(request_id, sink)
        else:
            try:
                loop.call_soon_threadsafe(self._abort_if, request_id, sink)
            except RuntimeError:  # the home loop is closed: its requests are gone with its socket
                pass

    def _abort_if(self, request_id: str, sink: OutputSink) -> None:
        t = self._requests.get(request_id)
        if t is not None and t.sink is sink:
            del self._requests[request_id]
            self._queue_aborts([request_id])

    def _queue_aborts(self, request_ids: list[str]) -> None:
        """One Abort message per loop pass, however many streams closed in it (a disconnect storm)."""
        if not self._aborts:
            self._loop.call_soon(self._flush_aborts)
        self._aborts.extend(request_ids)

    def _flush_aborts(self) -> None:
        ids, self._aborts = self._aborts, []
        if ids and self._socket is not None and not self._closing:
            self._send(m.Abort(ids))

    # ------------------------------------------------------------------ what the core sends
    async def _read(self) -> None:
        sock = self._socket
        try:
            while True:
                batch = [await sock.recv()]
                while sock.get(zmq.EVENTS) & zmq.POLLIN:  # take what is there: handled together
                    batch.append(await sock.recv())
                self._handle(batch)
        except asyncio.CancelledError:
            raise
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self._die(EngineFatalError(f"a malformed message from the engine core: {e}"))
        except zmq.ZMQError as e:
            if not self._closing:
                self._die(EngineFatalError(f"the engine core's socket failed: {e}"))
        except Exception as e:  # a bug here: nothing it was reading for can be trusted to finish
            logger.exception("engine core client: handling the core's messages failed")
            self._die(EngineFatalError(f"handling the engine core's messages failed: {type(e).__name__}: {e}"))

    def _handle(self, batch: list[bytes]) -> None:
        msgs = [m.CORE_DECODER.decode(raw) for raw in batch]  # (a malformed one: nothing of the batch is used)
        pending: dict[str, list[m.CoreOutput]] = {}
        for msg in msgs:
            if isinstance(msg, m.StepOutputs):
                for out in msg.outputs:
                    pending.setdefault(out.request_id, []).append(out)
                if msg.stats is not None:
                    self._stats = msg.stats
            elif isinstance(msg, m.Reply):
                self._resolve(msg)
            elif isinstance(msg, m.Dead):
                self._die(EngineFatalError(f"the engine is dead: {msg.message}"))
                return
            elif isinstance(msg, m.Refused):
                logger.error("engine core refused a message of this client: %s", msg.message)
        items: list[tuple[OutputSink, RequestOutput | BaseException]] = []
        finished_here: list[str] = []
        for rid, outs in pending.items():
            t = self._requests.get(rid)
            if t is None:  # aborted or finished here meanwhile
                continue
            item = self._apply(t.group, outs)
            if item is None:
                continue
            items.append((t.sink, item))
            if isinstance(item, BaseException) or item.finished:
                del self._requests[rid]
                if not isinstance(item, BaseException) and not outs[-1].finished:
                    finished_here.append(rid)  # a stop string: the core still runs it
        if finished_here:
            self._queue_aborts(finished_here)
        deliver(items, self._loop)

    def _apply(self, group: RequestState, outs: list[m.CoreOutput]) -> RequestOutput | BaseException | None:
        """The core's outputs of one request (one or more steps, in order) through the output
        processor: its RequestOutput (None: nothing to tell the consumer yet)."""
        proc = self.output
        touched: dict[int, Request] = {}
        finishes: dict[int, tuple[str, int | str | None]] = {}
        for out in outs:
            if out.error is not None:
                return RequestFailedError(out.error)
            group.seqs[0].num_cached_tokens = out.num_cached_tokens
            if out.prompt_logprobs is not None:
                group.prompt_logprobs = out.prompt_logprobs
            for d in out.seqs:
                st = group.states.get(d.index)
                if st is not None and st.finish_reason is not None:  # ended here by a stop string
                    continue
                seq = group.seqs.get(d.index)
                if seq is None:
                    seq = group.seqs[d.index] = self._sample(group, d.index)
                seq.token_ids.extend(d.token_ids)
                if d.logprobs:
                    seq.logprobs.extend((lp.logprob, lp.top_logprobs, lp.rank) for lp in d.logprobs)
                if d.finish_reason is not None:
                    finishes[d.index] = (d.finish_reason, d.stop_reason)
                touched[d.index] = seq
        for index, seq in touched.items():
            finish = proc.process_tokens(group, seq)
            if finish is None and index in finishes:
                reason, stop_reason = finishes[index]
                finish = (RequestStatus(reason), stop_reason)
            if finish is not None:
                proc.finish(group, seq, *finish)
        if not touched and not any(o.prompt_logprobs is not None for o in outs):
            return None
        if group.finished or group.params.output_kind != "final_only":
            return proc.make_output(group)
        return None

    @staticmethod
    def _sample(group: RequestState, index: int) -> Request:
        seq = Request(group.request_id, (), group.params, 0, 0, index)
        seq.token_ids = array("q", group.prompt_token_ids)
        seq.num_prompt_tokens = len(group.prompt_token_ids)
        return seq

    def _resolve(self, reply: m.Reply) -> None:
        future = self._calls.pop(reply.call_id, None)
        if future is None or future.done():
            return
        if reply.error_kind is None:
            future.set_result(reply.result)
        else:
            future.set_exception(_ERRORS.get(reply.error_kind, RequestFailedError)(reply.error))

    # ------------------------------------------------------------------ the end
    def _check_alive(self) -> None:
        if self.fatal_error is not None:
            raise EngineFatalError(str(self.fatal_error))
        if self._closing:
            raise EngineDeadError("the engine is shut down")

    def _die(self, error: EngineFatalError) -> None:
        """The core can no longer be trusted with anything: every request and call ends with ``error``."""
        if self.fatal_error is not None or self._closing:
            return
        logger.critical("%s; ending the %d in-flight requests", error, len(self._requests))
        self.fatal_error = error
        self._end_all(error)

    def _end_all(self, error: BaseException) -> None:
        items = [(t.sink, error) for t in self._requests.values()]
        self._requests.clear()
        for future in self._calls.values():
            if not future.done() and not future.get_loop().is_closed():
                future.set_exception(error)
        self._calls.clear()
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:  # close() without a loop
            here = None
        deliver(items, here)

    def _core_exited(self) -> None:
        self._exited = True
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)
        if self._closing:
            return
        status = ""
        if self._process is not None:
            self._process.process.join(1.0)
            status = f" with status {self._process.exitcode}"
        self._die(EngineFatalError(f"the engine-core process {self.facts.pid} exited{status}"))

    def _poll_core(self) -> None:
        if self._closing or self._exited or self._loop is None or self._loop.is_closed():
            return
        if not is_alive(self.facts.pid):
            self._core_exited()
        else:
            self._loop.call_later(0.5, self._poll_core)

    async def _close_home(self) -> None:
        if self._closing:
            return
        self._closing = True
        ours = list(self._requests) + self._aborts
        self._end_all(EngineDeadError("the engine is shutting down"))
        if self._socket is not None and not self._exited:
            if self._process is not None:
                self._send(m.Shutdown())
                self._shutdown_sent = True
            elif ours:  # a shared core: only this client's requests end
                self._send(m.Abort(ours))
        self._unbind()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _stop_process(self, timeout: float) -> None:
        if not self._shutdown_sent and self._process.process.is_alive():
            self._process.process.terminate()  # no Shutdown went out: SIGTERM asks it to stop the same way
        code = self._process.stop(timeout)
        self._exited = True
        if code not in (0, None) and self.fatal_error is None:
            logger.warning("the engine core exited with status %s", code)
