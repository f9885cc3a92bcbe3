"""``prefixkv serve --api-server-count N``: one engine-core process, N HTTP processes on one port.

::

    this process: binds the port, starts the engine core and the N HTTP processes, then watches them
      |-- engine core (prefixkv/engine_core/core.py)       one ZMQ ROUTER, N clients
      |-- HTTP process 1 .. N: the aiohttp app over an EngineCoreClient each, accepting on the same
          listening socket (the kernel hands each connection to one of them)

The HTTP processes share nothing but the core: each tokenizes, detokenizes and streams its own
requests; /metrics sums the request metrics of all of them (prometheus-client's multiprocess mode,
files in a temporary directory) beside the engine's own statistics. SIGTERM / SIGINT stop the HTTP
processes first (their requests are aborted), then the core (it writes the disk KV tier): exit 0.
If the core dies, each HTTP process answers 503 and exits 1; when any process ends on its own,
the others are stopped and this one exits 1.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import tempfile
import time
from multiprocessing.connection import wait
from typing import TYPE_CHECKING

from prefixkv.engine_core.process import available_cpus, engine_threads

if TYPE_CHECKING:
    from prefixkv.config import EngineConfig
    from prefixkv.engine_core.core import CoreFacts
    from prefixkv.server.serving import ServerConfig

logger = logging.getLogger(__name__)

PROMETHEUS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


def listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=1024)


def run_api_servers(engine_config: EngineConfig, config: ServerConfig, host: str, port: int, count: int,
                    threads: int | None = None) -> int:
    from prefixkv.engine_core.client import CoreProcess
    from prefixkv.server.app import url_for

    stop = {"signal": None}

    def on_signal(signum, frame):
        stop["signal"] = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        sock = listening_socket(host, port)
    except OSError as e:
        print(f"prefixkv: error: cannot listen on {host}:{port}: {e}")
        return 1
    metrics_dir = tempfile.mkdtemp(prefix="prefixkv-metrics-")
    os.environ[PROMETHEUS_DIR_ENV] = metrics_dir  # before the HTTP processes import prometheus_client
    core = CoreProcess(engine_config, threads=threads or engine_threads(available_cpus(), count))
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Queue()
    servers = [ctx.Process(target=_http_process, name=f"prefixkv-http-{i}",
                           args=(core.address, core.facts, config, host, sock, ready))
               for i in range(count)]
    for p in servers:
        p.start()
    url = url_for(host, sock.getsockname()[1])
    sock.close()  # the HTTP processes hold it now
    status = _watch(core, servers, ready, stop, config, url)
    for s, h in old.items():
        signal.signal(s, h)
    return status


def _watch(core, servers, ready, stop, config, url) -> int:
    """Until a signal (0) or a process ending on its own (1); then the HTTP processes, then the core."""
    num_ready, status = 0, 0
    sentinels = {p.sentinel: p for p in servers}
    sentinels[core.process.sentinel] = core.process
    while stop["signal"] is None:
        ended = wait(list(sentinels), timeout=0.2)
        if ended:
            who = sentinels[ended[0]]
            logger.error("%s (pid %d) exited with status %s; stopping the others", who.name, who.pid, who.exitcode)
            status = 1
            break
        while num_ready < len(servers) and not ready.empty():
            ready.get()
            num_ready += 1
            if num_ready == len(servers):
                print(f"prefixkv serving {config.model_name} at {url} ({len(servers)} HTTP processes, engine "
                      f"core {core.pid})", flush=True)
    for p in servers:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 30
    for p in servers:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
        if p.exitcode not in (0, None) and stop["signal"] is not None:
            status = 1
    if core.process.is_alive():
        core.process.terminate()  # SIGTERM: it aborts what is left and writes the disk tier
    code = core.stop(30.0)
    if code not in (0, None):
        status = 1
    return status


def _http_process(address: str, facts: CoreFacts, config: ServerConfig, host: str, sock: socket.socket,
                  ready) -> None:
    from prefixkv.engine_core.client import EngineCoreClient
    from prefixkv.server.app import run_event_loop, serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the parent stops us with SIGTERM
    engine = EngineCoreClient(address, facts)
    raise SystemExit(run_event_loop(serve(engine, config, host, sock.getsockname()[1], sock=sock,
                                          on_ready=lambda url: ready.put(os.getpid()), signals=(signal.SIGTERM,))))
