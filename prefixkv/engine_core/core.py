"""The engine-core process: an ``LLMEngine`` stepped by the process's main thread, its requests
arriving on a ZMQ ROUTER socket from one or more clients (engine_core/client.py).

One pass of the loop::

    receive every message waiting (block while there is nothing to step: Hello, AddRequests,
      Abort, Call, Shutdown) -> engine.step() -> one StepOutputs per client that has requests in
      it -> the statistics, when due

Nothing else runs in this process between steps: no HTTP, no detokenization, no JSON. Requests
run with token ids only (``messages.core_params``). A request's grammar is compiled on a worker
thread before the request is queued, so that a new schema never holds up the running requests'
steps.

Ends:
- ``Shutdown`` from the owning client, SIGTERM, or the parent process gone: every request is
  aborted, the disk KV tier gets every cached block (``LLMEngine.shutdown``: the next start finds
  them; the last KV events go out), exit status 0.
- ``EngineFatalError`` from a step: every client gets ``Dead``, exit status 1 (the KV cache is
  not trusted, so not flushed).
- A step that raises anything else fails its requests and the loop goes on (as ``AsyncEngine``).

A message that cannot be decoded is answered (``Reply`` with an error when its call id can be
read, ``Refused`` otherwise) and skipped: an error for the sender, never a hang.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import msgspec
import zmq

from prefixkv.engine_core import messages as m
from prefixkv.errors import EngineFatalError
from prefixkv.serve.load import queue_state

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from prefixkv.config import EngineConfig
    from prefixkv.engine import LLMEngine
    from prefixkv.outputs import RequestOutput

logger = logging.getLogger("prefixkv.engine_core")

IDLE_WAKE_S = 0.1  # an idle core looks at its stop flag and its parent this often
EMPTY_STEP_WAIT_S = 0.005  # a step that scheduled nothing (waiting for disk reads): wait this long for messages
STATS_PERIOD_S = 0.1  # statistics go out this often while the same requests run

# Calls a client may make (``EngineCoreClient.call``): name -> fn(engine, *args); results are
# MessagePack-able.
UTILITIES: dict[str, Callable[..., Any]] = {
    "cache_summary": lambda engine, max_nodes, text_tokens=0: engine.cache_summary(max_nodes, text_tokens),
    "routing_digest": lambda engine: engine.scheduler.kv.routing_digest(),
    "queue_state": lambda engine: queue_state(engine),
    "kv_events_info": lambda engine: engine.kv_events_info(),
    "check_integrity": lambda engine: engine.check_integrity(),
    "stats": lambda engine: engine.stats(),
    "reset_prefix_cache": lambda engine: engine.reset_prefix_cache(),
    "release_retention": lambda engine, handle: engine.release_retention(handle),
}


@dataclass(frozen=True)
class CoreFacts:
    """What a client needs of the engine without asking it again (sent once, when it is ready)."""

    model_path: str
    num_kv_blocks: int
    max_model_len: int
    eos_token_ids: list[int]
    vocab_size: int
    block_size: int
    max_num_seqs: int
    max_waiting_requests: int
    default_sampling: dict[str, Any]
    threads: int
    pid: int
    stats: dict[str, Any] = field(default_factory=dict)


class EngineCore:
    def __init__(self, engine: LLMEngine, address: str, parent_pid: int | None = None) -> None:
        self.engine = engine
        self.parent_pid = parent_pid
        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 2000)  # Dead and the last outputs reach the clients
        # no message is ever dropped for a slow client (a lost output would hang its request), and
        # one to a client that is gone is an error here, not silence
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._socket.bind(address)
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._clients: set[bytes] = set()
        self._owner: dict[str, bytes] = {}  # request id -> the client that added it
        self._prompt_logprobs_sent: set[str] = set()
        self._compiling: list[tuple[concurrent.futures.Future, bytes, m.AddRequests, Any]] = []
        self._grammar_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._stop = False
        self._stats_sent: dict[str, Any] | None = None
        self._stats_at = 0.0
        self._num_unfinished_sent = 0
        self._encoder = msgspec.msgpack.Encoder()

    # ------------------------------------------------------------------ the loop
    def request_stop(self) -> None:
        """Safe from a signal handler: the loop ends at its next pass."""
        self._stop = True

    def run(self) -> int:
        """Serve until asked to stop (0) or the engine dies (1)."""
        engine = self.engine
        empty_step = False
        while not self._stop:
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                logger.warning("the process that started the engine core is gone; stopping")
                break
            busy = engine.has_unfinished()
            timeout = EMPTY_STEP_WAIT_S if (empty_step or self._compiling) else (0.0 if busy else IDLE_WAKE_S)
            self._receive(timeout)
            if self._compiling:
                self._admit_compiled()
            outputs = None
            if engine.has_unfinished():
                num_steps = engine.num_steps
                outputs = self._step()
                if outputs is None:
                    return 1
                empty_step = engine.num_steps == num_steps
            else:
                empty_step = False
            self._publish_stats()  # first: a client that sees a request end sees the statistics after it
            if outputs:
                self._send_outputs(outputs)
        self._close()
        return 0

    def _receive(self, timeout_s: float) -> None:
        """Handle every message waiting; wait up to ``timeout_s`` for the first."""
        if not self._poller.poll(int(timeout_s * 1000)):
            return
        sock = self._socket
        while True:
            try:
                identity, raw = sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            except ValueError:  # not two frames: nothing to answer it on
                logger.error("engine core: a message that is not [identity, payload] was dropped")
                continue
            self._handle(identity, raw)
            if self._stop:
                return

    def _handle(self, identity: bytes, raw: bytes) -> None:
        try:
            msg = m.CLIENT_DECODER.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self._refuse(identity, raw, e)
            return
        if isinstance(msg, m.AddRequests):
            self._add(identity, msg)
        elif isinstance(msg, m.Abort):
            self._abort(identity, msg.request_ids)
        elif isinstance(msg, m.Call):
            self._call(identity, msg)
        elif isinstance(msg, m.Hello):
            self._clients.add(identity)
        elif isinstance(msg, m.Shutdown):
            logger.info("engine core: shutdown asked")
            self._stop = True

    def _refuse(self, identity: bytes, raw: bytes, error: Exception) -> None:
        """Answer a message that did not decode: the call it names, if any, fails with the error."""
        why = f"malformed message to the engine core: {error}"
        logger.error("%s (%d bytes from client %s)", why, len(raw), identity.hex())
        try:
            head = msgspec.msgpack.decode(raw)
        except msgspec.DecodeError:
            head = None
        if (isinstance(head, list) and len(head) > 1 and head[0] in ("add", "call")
                and isinstance(head[1], int) and not isinstance(head[1], bool)):
            self._send(identity, m.Reply(head[1], error_kind="invalid", error=why))
        else:
            self._send(identity, m.Refused(why))

    # ------------------------------------------------------------------ requests
    def _add(self, identity: bytes, msg: m.AddRequests) -> None:
        try:
            params = m.params_from_wire(msg.params)
        except (TypeError, ValueError) as e:
            self._reply_error(identity, msg.call_id, e)
            return
        so = params.structured_outputs
        if so is not None:  # compiled off this thread: the running requests keep stepping meanwhile
            if self._grammar_pool is None:
                self._grammar_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefixkv-grammar")
            self._compiling.append((self._grammar_pool.submit(self.engine.grammars.compile, so), identity, msg,
                                    params))
            return
        self._add_now(identity, msg, params)

    def _admit_compiled(self) -> None:
        waiting = []
        for item in self._compiling:
            future, identity, msg, params = item
            if not future.done():
                waiting.append(item)
            elif future.exception() is not None:
                self._reply_error(identity, msg.call_id, future.exception())
            else:
                self._add_now(identity, msg, params)
        self._compiling = waiting

    def _add_now(self, identity: bytes, msg: m.AddRequests, params: Any) -> None:
        """All of ``msg``'s requests or none (those added before a refused one are aborted)."""
        added: list[str] = []
        try:
            for request_id, prompt_token_ids in msg.requests:
                self.engine.add_request(request_id, prompt_token_ids, params)
                added.append(request_id)
        except Exception as e:
            for request_id in added:
                self.engine.abort(request_id)
            self._reply_error(identity, msg.call_id, e)
            return
        for request_id in added:
            self._owner[request_id] = identity
        self._send(identity, m.Reply(msg.call_id, True))

    def _abort(self, identity: bytes, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if self._owner.get(request_id) == identity:
                del self._owner[request_id]
                self._prompt_logprobs_sent.discard(request_id)
                self.engine.abort(request_id)

    def _call(self, identity: bytes, msg: m.Call) -> None:
        fn = UTILITIES.get(msg.method)
        if fn is None:
            self._send(identity, m.Reply(msg.call_id, error_kind="invalid",
                                         error=f"method: {msg.method!r} is not one of {', '.join(UTILITIES)}"))
            return
        try:
            result = fn(self.engine, *msg.args)
        except Exception as e:
            logger.exception("engine core: call %s failed", msg.method)
            self._reply_error(identity, msg.call_id, e)
            return
        self._send(identity, m.Reply(msg.call_id, result))

    def _reply_error(self, identity: bytes, call_id: int, error: BaseException) -> None:
        self._send(identity, m.Reply(call_id, error_kind=m.error_kind(error), error=str(error)))

    # ------------------------------------------------------------------ steps
    def _step(self) -> list[RequestOutput] | None:
        """One engine step: its outputs; None once the engine is dead (every client told)."""
        try:
            return self.engine.step()
        except EngineFatalError as e:
            logger.critical("engine core: the engine is dead (%s); ending %d requests", e, len(self._owner))
            self._broadcast(m.Dead(str(e)))
            self._close(flush=False)
            return None
        except Exception as e:  # a bug in the step itself: its requests end with the error, the loop goes on
            logger.exception("engine core: step failed; aborting the %d requests", len(self._owner))
            self._fail_all(e)
            return []

    def _send_outputs(self, outputs: list[RequestOutput]) -> None:
        by_client: dict[bytes, list[m.CoreOutput]] = {}
        owner = self._owner
        for out in outputs:
            identity = owner.get(out.request_id)
            if identity is None:  # aborted meanwhile
                continue
            if out.finished:
                del owner[out.request_id]
            by_client.setdefault(identity, []).append(self._wire(out))
        for identity, batch in by_client.items():
            self._send(identity, m.StepOutputs(batch))

    def _wire(self, out: RequestOutput) -> m.CoreOutput:
        seqs = [m.SeqDelta(co.index, co.delta_token_ids, co.finish_reason, co.stop_reason, co.delta_token_logprobs)
                for co in out.outputs if co.delta_token_ids or co.finish_reason is not None]
        plps = None
        rid = out.request_id
        if out.prompt_token_logprobs is not None and rid not in self._prompt_logprobs_sent:
            plps = out.prompt_token_logprobs
            self._prompt_logprobs_sent.add(rid)
        if out.finished:
            self._prompt_logprobs_sent.discard(rid)
        if out.error is not None:
            return m.CoreOutput(rid, [], True, out.num_cached_tokens, out.error)
        return m.CoreOutput(rid, seqs, out.finished, out.num_cached_tokens, None, plps)

    def _fail_all(self, error: BaseException) -> None:
        text = f"{type(error).__name__}: {error}"
        by_client: dict[bytes, list[m.CoreOutput]] = {}
        for request_id, identity in self._owner.items():
            self.engine.abort(request_id)
            by_client.setdefault(identity, []).append(m.CoreOutput(request_id, [], True, 0, text))
        self._owner.clear()
        self._prompt_logprobs_sent.clear()
        for identity, batch in by_client.items():
            self._send(identity, m.StepOutputs(batch))

    def _publish_stats(self) -> None:
        """The engine's statistics to every client when they changed: at once when a request came
        or went (the engine idle included), else at most every ``STATS_PERIOD_S``."""
        now = time.monotonic()
        num = self.engine.num_unfinished
        if now - self._stats_at < STATS_PERIOD_S and num == self._num_unfinished_sent:
            return
        stats = self.engine.stats()
        self._stats_at, self._num_unfinished_sent = now, num
        if stats == self._stats_sent:
            return
        self._stats_sent = stats
        self._broadcast(m.StepOutputs([], stats))

    # ------------------------------------------------------------------ plumbing
    def _send(self, identity: bytes, msg: Any) -> None:
        try:
            self._socket.send_multipart((identity, self._encoder.encode(msg)))
        except zmq.ZMQError as e:  # EHOSTUNREACH: the client is gone (its process ended)
            self._forget_client(identity, e)

    def _forget_client(self, identity: bytes, error: Exception) -> None:
        self._clients.discard(identity)
        gone = [rid for rid, owner in self._owner.items() if owner == identity]
        logger.warning("engine core: client %s is gone (%s); aborting its %d requests", identity.hex(), error,
                       len(gone))
        for request_id in gone:
            del self._owner[request_id]
            self.engine.abort(request_id)

    def _broadcast(self, msg: Any) -> None:
        for identity in self._clients | set(self._owner.values()):
            self._send(identity, msg)

    def _close(self, flush: bool = True) -> None:
        for request_id in list(self._owner):
            self.engine.abort(request_id)
        self._owner.clear()
        if self._grammar_pool is not None:
            self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        try:
            n = self.engine.shutdown(flush)
            if n:
                logger.info("engine core: %d cached blocks written to the disk tier", n)
        except Exception:
            logger.exception("engine core: writing the KV cache to disk failed")
        self._socket.close()
        self._ctx.term()


def run_engine_core(config: EngineConfig, address: str, ready: Connection, parent_pid: int,
                    threads: int | None = None, make_engine: Callable[[EngineConfig], LLMEngine] | None = None) -> None:
    """The process's entry point (``multiprocessing`` spawn; engine_core/client.py starts it):
    build the engine, tell the parent over ``ready`` (``("ready", CoreFacts)`` or ``("error", type
    name, message)``), serve, exit 0 / 1."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent decides
    stop_early = lambda *_: os._exit(0)  # noqa: E731 - SIGTERM while the model loads
    signal.signal(signal.SIGTERM, stop_early)
    import torch

    from prefixkv.engine import LLMEngine
    from prefixkv.engine_core.process import tune_gc_for_serving

    if threads is not None:
        torch.set_num_threads(threads)
    try:
        engine = (make_engine or LLMEngine)(config)
    except Exception as e:
        ready.send(("error", type(e).__name__, str(e)))
        ready.close()
        raise SystemExit(1) from None
    try:
        core = EngineCore(engine, address, parent_pid)
    except zmq.ZMQError as e:
        ready.send(("error", "RuntimeError", f"the engine core cannot bind {address}: {e}"))
        raise SystemExit(1) from None
    signal.signal(signal.SIGTERM, lambda *_: core.request_stop())
    frozen = tune_gc_for_serving()
    info, sched = engine.info, config.scheduler
    facts = CoreFacts(model_path=str(engine.model_path), num_kv_blocks=info.num_kv_blocks,
                      max_model_len=info.max_model_len, eos_token_ids=list(info.eos_token_ids),
                      vocab_size=info.vocab_size, block_size=config.cache.block_size,
                      max_num_seqs=sched.max_num_seqs, max_waiting_requests=sched.max_waiting_requests,
                      default_sampling=dict(engine.default_sampling), threads=torch.get_num_threads(),
                      pid=os.getpid(), stats=engine.stats())
    logger.info("engine core %d ready at %s: %d torch threads, %d start-up objects frozen out of the garbage "
                "collector's walks", os.getpid(), address, facts.threads, frozen)
    ready.send(("ready", facts))
    ready.close()
    raise SystemExit(core.run())
