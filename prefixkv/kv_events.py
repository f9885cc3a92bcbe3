"""KV cache events on the wire, as vLLM publishes them (``vllm/distributed/kv_events.py``), so
vLLM's own decoder and the routers built on it (llm-d, Dynamo) read ours.

Wire format (msgpack, msgspec structs; the schema is in ``wire_schema``):

* one ZMQ multipart message per batch: ``(topic, sequence, payload)``, the sequence an 8-byte
  big-endian counter from 0, the payload an ``EventBatch``: an array ``[ts, events, rank]``;
* each event a map tagged ``"type"``: ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``
  with vLLM's field names, defaults left out (vLLM's events are maps since its #42892);
* replay: a ROUTER socket takes ``(identity, b"", start_seq)`` (a REQ client's request, or a
  DEALER's with the empty frame) and answers each kept batch from ``start_seq`` on with
  ``(identity, b"", topic, seq, payload)``, then ``(identity, b"", b"", -1 as 8 signed bytes, b"")``.

The cache builds plain events (``kv/events.py``); ``EventPublisher.publish`` takes one step's
list and returns at once: a background thread converts, encodes and sends, so the engine's step
never waits on a socket. msgspec and pyzmq are imported when a ZMQ publisher starts.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections import deque
from types import SimpleNamespace
from typing import Any, Sequence, Union

from prefixkv.config import KVEventsConfig
from prefixkv.kv import events as ev

logger = logging.getLogger(__name__)


@functools.cache
def wire_schema() -> SimpleNamespace:
    """vLLM's structs (field names, order, defaults and struct options), built on first use."""
    import msgspec

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int | bytes]
        parent_block_hash: int | bytes | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None
        locality: str | None = None
        ownership: str | None = None
        session_id: str | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int | bytes]
        medium: str | None
        group_idx: int | None = None
        locality: str | None = None
        ownership: str | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    # the classes above are local: their names in this annotation (a string, as every one here)
    # would not resolve where a decoder looks them up (serve/kv_subscriber.py decodes batches)
    KVEventBatch.__annotations__["events"] = list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]

    return SimpleNamespace(EventBatch=EventBatch, BlockStored=BlockStored, BlockRemoved=BlockRemoved,
                           AllBlocksCleared=AllBlocksCleared, KVEventBatch=KVEventBatch)


def to_wire(ts: float, events: Sequence[ev.KVCacheEvent], data_parallel_rank: int | None = None) -> Any:
    """One step's plain events as vLLM's ``KVEventBatch`` (no LoRA here: lora_id and lora_name null)."""
    w = wire_schema()
    out = []
    for e in events:
        if isinstance(e, ev.BlockStored):
            out.append(w.BlockStored(
                block_hashes=list(e.block_hashes), parent_block_hash=e.parent_block_hash, token_ids=list(e.token_ids),
                block_size=e.block_size, lora_id=None, medium=e.medium, lora_name=None, extra_keys=list(e.extra_keys),
                group_idx=e.group_idx, kv_cache_spec_kind=e.kv_cache_spec_kind,
                kv_cache_spec_sliding_window=e.kv_cache_spec_sliding_window))
        elif isinstance(e, ev.BlockRemoved):
            out.append(w.BlockRemoved(block_hashes=list(e.block_hashes), medium=e.medium, group_idx=e.group_idx))
        elif isinstance(e, ev.AllBlocksCleared):
            out.append(w.AllBlocksCleared())
        else:
            raise TypeError(f"not a KV cache event: {e!r}")
    return w.KVEventBatch(ts=ts, events=out, data_parallel_rank=data_parallel_rank)


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """vLLM's per-rank address: a tcp port + rank, an inproc name + ``_dp{rank}``; rank 0 as given."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{data_parallel_rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + data_parallel_rank}"
    raise ValueError(f"kv_events_config.endpoint: a rank > 0 needs a tcp:// or inproc:// address, got {endpoint!r}")


class EventPublisher:
    """Takes one engine step's events at a time."""

    def publish(self, events: Sequence[ev.KVCacheEvent], ts: float | None = None) -> bool:
        """Queue ``events`` as one batch (nothing for an empty list). False: the batch was dropped."""
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError


class NullEventPublisher(EventPublisher):
    """Events disabled (``publisher="null"``): drops every batch."""

    def publish(self, events: Sequence[ev.KVCacheEvent], ts: float | None = None) -> bool:
        return True

    def shutdown(self) -> None:
        pass


class ZmqEventPublisher(EventPublisher):
    """A PUB socket sending each batch with its sequence number, a bounded replay buffer behind a
    ROUTER socket, and a thread that owns both sockets.

    ``publish`` never blocks: with ``max_queue_size`` batches waiting it drops the batch, counts
    it in ``num_dropped_batches`` and returns False; the next batch it queues then starts with
    ``AllBlocksCleared``, so subscribers forget a view that has a hole in it (the cache may follow
    with what it holds). A subscriber too slow for the socket's ``hwm`` loses messages instead and
    sees a gap in the sequence: the replay socket fills it while the batches are in the buffer.
    """

    SHUTDOWN_TIMEOUT = 1.0  # seconds the thread gets to send what is queued
    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.num_dropped_batches = 0
        self.endpoint = offset_endpoint_port(config.endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint_port(config.replay_endpoint, data_parallel_rank)
        self._topic = config.topic.encode()
        self._queue: queue.Queue[tuple[float, list[ev.KVCacheEvent]] | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._lost = False  # a batch was dropped (or failed to send) since the last one queued
        self._lost_lock = threading.Lock()
        self._closed = False
        self._abort = threading.Event()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="prefixkv-kv-events", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error

    def publish(self, events: Sequence[ev.KVCacheEvent], ts: float | None = None) -> bool:
        if self._closed:
            raise RuntimeError("the KV event publisher is shut down")
        if not events:
            return True
        with self._lost_lock:
            batch = [ev.AllBlocksCleared(), *events] if self._lost else list(events)
            try:
                self._queue.put_nowait((time.time() if ts is None else ts, batch))
            except queue.Full:
                self.num_dropped_batches += 1
                self._lost = True
            else:
                self._lost = False
                return True
        if self.num_dropped_batches & (self.num_dropped_batches - 1) == 0:  # 1, 2, 4, ...
            logger.warning("KV events: %d batches dropped (max_queue_size=%d reached); subscribers are told to "
                           "clear", self.num_dropped_batches, self.config.max_queue_size)
        return False

    def shutdown(self) -> None:
        """Send what is queued (within ``SHUTDOWN_TIMEOUT``), then close the sockets."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(None, timeout=self.SHUTDOWN_TIMEOUT)
        except queue.Full:
            pass
        self._thread.join(self.SHUTDOWN_TIMEOUT)
        if self._thread.is_alive():
            logger.warning("KV events: %d batches not sent at shutdown", self._queue.qsize())
            self._abort.set()
            self._thread.join()

    def _open(self, zmq: Any) -> tuple[Any, Any]:
        ctx = zmq.Context.instance()  # inproc:// subscribers share it
        sockets = [ctx.socket(zmq.PUB)]
        try:
            sockets[0].set_hwm(self.config.hwm)
            e = self.endpoint
            # vLLM: bind a stable address (a wildcard, ipc, inproc), connect to any other
            bind = "*" in e or "::" in e or e.startswith(("ipc://", "inproc://"))
            self.endpoint = _attach(zmq, sockets[0], "endpoint", e, bind)
            if self.replay_endpoint is not None:
                sockets.append(ctx.socket(zmq.ROUTER))
                self.replay_endpoint = _attach(zmq, sockets[1], "replay_endpoint", self.replay_endpoint, True)
        except Exception:
            for sock in sockets:
                sock.close(linger=0)
            raise
        return sockets[0], sockets[1] if len(sockets) > 1 else None

    def _run(self) -> None:
        try:
            try:
                import msgspec
                import zmq
            except ImportError as e:
                raise ImportError(f"KV events need msgspec and pyzmq (pip install 'prefixkv[server]'): {e}") from e
            pub, replay = self._open(zmq)
        except Exception as e:  # raised by __init__
            self._error = e
            self._started.set()
            return
        self._started.set()
        encoder = msgspec.msgpack.Encoder()
        seq = 0
        try:
            while not self._abort.is_set():
                if replay is not None and replay.poll(0):
                    try:
                        self._serve_replay(replay)
                    except Exception:
                        logger.exception("KV events: a replay request failed")
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if item is None:
                    break
                try:
                    payload = encoder.encode(to_wire(item[0], item[1], self.data_parallel_rank))
                    pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                except Exception:
                    logger.exception("KV events: a batch could not be sent")
                    with self._lost_lock:
                        self._lost = True
                    continue
                self._buffer.append((seq, payload))
                seq += 1
        finally:
            pub.close(linger=int(self.SHUTDOWN_TIMEOUT * 1000))
            if replay is not None:
                replay.close(linger=0)

    def _serve_replay(self, replay: Any) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV events: malformed replay request of %d frames", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", b"", self.END_SEQ, b""))


def _attach(zmq: Any, sock: Any, name: str, address: str, bind: bool) -> str:
    """Bind (returning the address bound, a wildcard port resolved) or connect ``sock``."""
    try:
        if not bind:
            sock.connect(address)
            return address
        sock.bind(address)
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)
    except zmq.ZMQError as e:
        raise ValueError(f"kv_events_config.{name}: cannot {'bind' if bind else 'connect to'} {address!r}: {e}") from e


def create_publisher(config: KVEventsConfig | None, data_parallel_rank: int = 0) -> EventPublisher:
    """The publisher ``config`` asks for: a ZMQ one when events are enabled with ``publisher="zmq"``."""
    if config is None or not config.enable_kv_cache_events or config.publisher == "null":
        return NullEventPublisher()
    return ZmqEventPublisher(config, data_parallel_rank)
