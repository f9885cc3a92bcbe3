"""A subscriber to the replicas' KV events (kv_events.py, vLLM's wire format), feeding one
``BlockView`` per replica (serve/block_view.py) for the routers' ``cache_view="events"``.

One thread owns every socket: per replica a SUB socket on its event endpoint and, for gaps, a
DEALER on its replay endpoint. ``watch`` / ``unwatch`` (from the router's thread) say which
replicas to follow; the thread connects and disconnects on its next turn. A new subscription
starts with a replay from sequence 0 (what the replica published before the router listened: its
buffer of ``buffer_steps`` batches); a batch past the next expected one starts a replay from that
one; what the replay cannot give marks the view ``lost`` (the router then matches the digest).
pyzmq and msgspec are imported when the thread starts.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from prefixkv.serve.block_view import BlockView

logger = logging.getLogger(__name__)

POLL_S = 0.05
REPLAY_TIMEOUT_S = 2.0
END_SEQ = -1


class EventSubscriber:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wanted: dict[str, tuple[str, str | None, str]] = {}
        self._views: dict[str, BlockView] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failed = False  # the thread ended on an error: the views are no longer fed

    def watch(self, key: str, endpoint: str, replay_endpoint: str | None, topic: str = "") -> BlockView:
        """Follow the replica ``key``'s events (again from scratch if its endpoints changed); its view."""
        want = (endpoint, replay_endpoint, topic)
        with self._lock:
            if self._wanted.get(key) != want:
                self._wanted[key] = want
                self._views[key] = BlockView()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="prefixkv-kv-subscriber", daemon=True)
                self._thread.start()
            return self._views[key]

    def view(self, key: str) -> BlockView | None:
        with self._lock:
            return self._views.get(key)

    def keys(self) -> set[str]:
        """The replicas followed."""
        with self._lock:
            return set(self._wanted)

    def unwatch(self, key: str) -> None:
        with self._lock:
            self._wanted.pop(key, None)
            self._views.pop(key, None)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)

    # ------------------------------------------------------------------ the thread
    def _open(self) -> None:
        import msgspec
        import zmq

        from prefixkv.kv_events import wire_schema

        self._zmq = zmq
        self._decoder = msgspec.msgpack.Decoder(wire_schema().KVEventBatch)
        self._ctx = zmq.Context()

    def _run(self) -> None:
        self._open()
        zmq = self._zmq
        poller = zmq.Poller()
        subs: dict[str, tuple[Any, tuple[str, str | None, str], BlockView]] = {}
        try:
            while not self._stop.is_set():
                with self._lock:
                    wanted = {k: (w, self._views[k]) for k, w in self._wanted.items()}
                for key in [k for k, (_, w, v) in subs.items() if k not in wanted or wanted[k] != (w, v)]:
                    sock = subs.pop(key)[0]
                    poller.unregister(sock)
                    sock.close(linger=0)
                for key, (w, view) in wanted.items():
                    if key not in subs:
                        sock = self._ctx.socket(zmq.SUB)
                        sock.setsockopt(zmq.SUBSCRIBE, w[2].encode())
                        sock.connect(w[0])
                        poller.register(sock, zmq.POLLIN)
                        subs[key] = (sock, w, view)
                        self._replay(w, view, 0)
                for sock, _ in poller.poll(int(POLL_S * 1000)):
                    key = next(k for k, s in subs.items() if s[0] is sock)
                    _, w, view = subs[key]
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._deliver(w, view, frames)
        except Exception:
            logger.exception("KV event subscriber failed; the routers fall back to the replicas' digests")
            self.failed = True
        finally:
            for sock, _, _ in subs.values():
                sock.close(linger=0)
            self._ctx.term()

    def _deliver(self, w: tuple[str, str | None, str], view: BlockView, frames: list[bytes]) -> None:
        if len(frames) != 3:
            return
        seq = int.from_bytes(frames[1], "big")
        batch = self._decoder.decode(frames[2])
        if view.apply(seq, batch):
            return
        self._replay(w, view, view.next_seq)  # the gap, from the replica's buffer
        if not view.apply(seq, batch):
            view.lost(seq)
            view.apply(seq, batch)

    def _replay(self, w: tuple[str, str | None, str], view: BlockView, start: int) -> None:
        """Apply the replica's buffered batches from ``start`` on; a hole at their start is lost."""
        if w[1] is None:
            return
        zmq = self._zmq
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.connect(w[1])
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            answered = False
            while sock.poll(int(REPLAY_TIMEOUT_S * 1000)):
                frames = sock.recv_multipart()
                if len(frames) != 4:
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    answered = True
                    break
                batch = self._decoder.decode(frames[3])
                if not view.apply(seq, batch):  # the buffer starts after the gap
                    view.lost(seq)
                    view.apply(seq, batch)
            if answered and start == 0:
                view.caught_up()
            elif not answered:
                logger.warning("KV events: no replay from %s within %.1f s", w[1], REPLAY_TIMEOUT_S)
        finally:
            sock.close(linger=0)
