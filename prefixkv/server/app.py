"""The aiohttp transport of the OpenAI-compatible server: routes, body limits, the API key,
OpenAI-shaped errors for aiohttp's own 404/405/413, SSE writing and client disconnects. The API
itself (parsing, templates, sampling parameters, engine calls, wire formats) is
``server/serving.py``, which knows no HTTP library.

Routes: POST /v1/chat/completions, POST /v1/completions, POST /v1/responses, GET and DELETE
/v1/responses/{id}, POST /v1/messages[/count_tokens] (Anthropic's), GET /v1/models[/{model}], GET /health,
GET /metrics, POST /tokenize, POST /detokenize, GET /version, POST /reset_prefix_cache (off unless
``--enable-reset-prefix-cache``), and the browser pages
(``server/webui.py``: GET /, GET /cache, GET /v1/cache/summary). A client that disconnects cancels
its handler, which closes its stream, which aborts its requests in the engine (their KV blocks are
freed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from prefixkv.engine_client import EngineClient
from prefixkv.engine_core.process import GC_YOUNG_THRESHOLD, tune_gc_for_serving
from prefixkv.server.protocol import ProtocolError
from prefixkv.server.serving import (  # noqa: F401 - ServerConfig and ApiError are this module's API too
    ApiError,
    OpenAIServing,
    Reply,
    ServerConfig,
    bad_request,
    read_body,
)
from prefixkv.server.webui import WebUI

if TYPE_CHECKING:
    from prefixkv.config import EngineConfig

logger = logging.getLogger(__name__)

# aiohttp >= 3.11 wants typed request keys; older versions have only str keys
_STATUS_KEY: Any = web.RequestKey("prefixkv_status", int) if hasattr(web, "RequestKey") else "prefixkv_status"
# nginx's code for "client closed the request"; only ever used as a metrics label
_CLIENT_CLOSED = 499

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def _http_error(e: web.HTTPException, request: web.Request) -> ApiError:
    """aiohttp's own errors (unknown route, wrong method, body too large) in the OpenAI shape."""
    if e.status == 413:
        return ApiError(413, f"the request body is larger than the server's limit: {e.text or e.reason}",
                        code="request_too_large")
    msg = f"{e.reason}: {request.method} {request.path}"
    headers = None
    if "Allow" in e.headers:
        headers = {"Allow": e.headers["Allow"]}
        msg += f" (allowed: {e.headers['Allow']})"
    kind = "invalid_request_error" if e.status < 500 else "server_error"
    return ApiError(e.status, msg, type=kind, code=_HTTP_CODES.get(e.status), headers=headers)



class _TransportWriter:
    """``ChunkWriter`` over a prepared streamed response's transport (aiohttp's
    ``StreamResponse.write`` awaits): the bytes framed as an HTTP/1.1 chunk where aiohttp's writer
    chunks the response, and nothing taken while 64 KiB wait in the transport's buffer (aiohttp's
    own limit). The response's headers went out in ``prepare``."""

    __slots__ = ("_transport", "_chunked")

    LIMIT = 0x10000

    def __init__(self, transport: asyncio.Transport, chunked: bool) -> None:
        self._transport = transport
        self._chunked = chunked

    def writable(self) -> bool:
        t = self._transport
        return not t.is_closing() and t.get_write_buffer_size() < self.LIMIT

    def write(self, data: bytes) -> None:
        self._transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)


def _response(reply: Reply) -> web.Response:
    return web.Response(status=reply.status, body=reply.body,
                        headers={**(reply.headers or {}), "Content-Type": reply.content_type})


class _AioServer:
    """aiohttp handlers over ``OpenAIServing``."""

    def __init__(self, engine: EngineClient, config: ServerConfig) -> None:
        self.api = OpenAIServing(engine, config)
        self.config = config

    # ------------------------------------------------------------------ middlewares
    @web.middleware
    async def errors_middleware(self, request: web.Request, handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        status = 500
        try:
            try:
                resp = await handler(request)
            except ApiError as e:
                resp = _response(self.api.error_reply(e, request.path))
            except ProtocolError as e:
                resp = _response(self.api.error_reply(bad_request(e), request.path))
            except web.HTTPException as e:
                resp = _response(self.api.error_reply(_http_error(e, request), request.path))
            except asyncio.CancelledError:  # handler_cancellation: the client disconnected
                status = _CLIENT_CLOSED
                raise
            except ConnectionResetError:  # nobody to answer; aiohttp drops the response quietly
                resp = web.Response(status=_CLIENT_CLOSED)
            except Exception:
                logger.exception("unhandled error in %s %s", request.method, request.path)
                resp = _response(self.api.error_reply(ApiError(500, "internal server error", type="server_error",
                                                               code="internal_error"), request.path))
            status = request.get(_STATUS_KEY, resp.status)
            return resp
        finally:
            self.api.metrics.requests.labels(route, str(status)).inc()

    @web.middleware
    async def auth_middleware(self, request: web.Request, handler) -> web.StreamResponse:
        self.api.authenticate(request.path, request.headers.get("Authorization"), request.headers.get("x-api-key"))
        return await handler(request)

    # ------------------------------------------------------------------ transport
    async def _body(self, request: web.Request, t0: float) -> bytes:
        return await read_body(request.content.iter_any(), request.content_length, self.config.max_body_bytes,
                               t0 + self.config.request_timeout)

    async def _send(self, request: web.Request, reply: Reply) -> web.StreamResponse:
        if reply.stream is None:
            return _response(reply)
        try:
            resp = web.StreamResponse(status=reply.status, headers=reply.headers)
            writer = await resp.prepare(request)
            transport = getattr(writer, "transport", None)  # (aiohttp's StreamWriter: chunked for HTTP/1.1)
            if transport is not None:
                reply.stream.writer = _TransportWriter(transport, writer.chunked)
            async for chunk in reply.stream:
                await resp.write(chunk)
            await resp.write_eof()
        except ConnectionResetError:  # the client went away
            request[_STATUS_KEY] = _CLIENT_CLOSED
        finally:  # finished, gone or cancelled: the requests behind the stream are aborted
            await reply.stream.aclose()
        return resp

    # ------------------------------------------------------------------ routes
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        t0 = asyncio.get_running_loop().time()
        return await self._send(request, await self.api.chat_completions(await self._body(request, t0), t0))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        t0 = asyncio.get_running_loop().time()
        return await self._send(request, await self.api.completions(await self._body(request, t0), t0))

    async def responses(self, request: web.Request) -> web.StreamResponse:
        t0 = asyncio.get_running_loop().time()
        return await self._send(request, await self.api.responses.create(await self._body(request, t0), t0))

    async def response(self, request: web.Request) -> web.Response:
        return _response(self.api.responses.get(request.match_info["response_id"]))

    async def delete_response(self, request: web.Request) -> web.Response:
        return _response(await self.api.responses.delete(request.match_info["response_id"]))

    async def messages(self, request: web.Request) -> web.StreamResponse:
        t0 = asyncio.get_running_loop().time()
        return await self._send(request, await self.api.messages.create(await self._body(request, t0), t0))

    async def count_tokens(self, request: web.Request) -> web.Response:
        t0 = asyncio.get_running_loop().time()
        return _response(await self.api.messages.count_tokens(await self._body(request, t0)))

    async def tokenize(self, request: web.Request) -> web.Response:
        t0 = asyncio.get_running_loop().time()
        return _response(await self.api.tokenize(await self._body(request, t0)))

    async def detokenize(self, request: web.Request) -> web.Response:
        t0 = asyncio.get_running_loop().time()
        return _response(await self.api.detokenize(await self._body(request, t0)))

    async def models(self, request: web.Request) -> web.Response:
        return _response(self.api.models())

    async def model(self, request: web.Request) -> web.Response:
        return _response(self.api.model(request.match_info["model"]))

    async def health(self, request: web.Request) -> web.Response:
        return _response(self.api.health())

    async def version(self, request: web.Request) -> web.Response:
        return _response(self.api.version())

    async def metrics_route(self, request: web.Request) -> web.Response:
        return _response(self.api.metrics_reply())

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        return _response(await self.api.reset_prefix_cache(request.query))


SERVER_KEY = web.AppKey("prefixkv_server", _AioServer)


def create_app(engine: EngineClient, config: ServerConfig) -> web.Application:
    """The aiohttp app. It owns ``engine``: the app's shutdown shuts the engine down (in-flight
    requests are aborted and end with an error)."""
    server = _AioServer(engine, config)
    app = web.Application(client_max_size=config.max_body_bytes,
                          middlewares=[server.errors_middleware, server.auth_middleware])
    app[SERVER_KEY] = server
    app.router.add_post("/v1/chat/completions", server.chat_completions)
    app.router.add_post("/v1/completions", server.completions)
    app.router.add_post("/v1/responses", server.responses)
    app.router.add_get("/v1/responses/{response_id}", server.response)
    app.router.add_delete("/v1/responses/{response_id}", server.delete_response)
    app.router.add_post("/v1/messages", server.messages)
    app.router.add_post("/v1/messages/count_tokens", server.count_tokens)
    app.router.add_get("/v1/models", server.models)
    app.router.add_get("/v1/models/{model}", server.model)
    app.router.add_get("/health", server.health)
    app.router.add_post("/tokenize", server.tokenize)
    app.router.add_post("/detokenize", server.detokenize)
    app.router.add_get("/version", server.version)
    app.router.add_get("/metrics", server.metrics_route)
    app.router.add_post("/reset_prefix_cache", server.reset_prefix_cache)
    WebUI(engine, config.model_name, config.cache_view_text).add_routes(app)

    async def on_startup(app: web.Application) -> None:
        await engine.start()

    async def on_shutdown(app: web.Application) -> None:
        await engine.shutdown()
        server.api.close()

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    return app


async def start_site(app: web.Application, host: str, port: int,
                     sock: socket.socket | None = None) -> tuple[web.AppRunner, int]:
    """Bind ``app`` (port 0 = any free port), or serve it on the listening ``sock``; returns the
    runner and the bound port."""
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its request.
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=10.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port) if sock is None else web.SockSite(runner, sock)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = port
    for addr in runner.addresses:
        if isinstance(addr, tuple):
            bound = addr[1]
            break
    return runner, bound


def url_for(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run_server(engine_config: EngineConfig, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
               api_server_count: int = 1, engine_process: bool = True, engine_threads: int | None = None) -> int:
    """``prefixkv serve``: load the model, serve until SIGTERM/SIGINT, exit 0 after a graceful stop
    (1 if the engine died).

    ``engine_process`` (the default): the engine steps in its own process (prefixkv/engine_core/)
    and this one, or ``api_server_count`` of them sharing the port, does the HTTP side; its compute
    threads: ``engine_threads``, by default ``process.engine_threads``' choice for the CPUs there
    are. Otherwise the engine steps in a thread of this process (``AsyncEngine``: one process, as
    ``LLM``; the threads torch picks)."""
    from prefixkv.engine_core import process

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    if api_server_count < 1:
        raise ValueError(f"api_server_count: must be >= 1, got {api_server_count}")
    if api_server_count > 1:
        if not engine_process:
            raise ValueError("api_server_count: several HTTP processes need the engine in its own process")
        from prefixkv.server.api_servers import run_api_servers

        return run_api_servers(engine_config, config, host, port, api_server_count, engine_threads)
    stop_early = lambda signum, frame: sys.exit(0)  # noqa: E731 - a signal while the model loads
    old = {s: signal.signal(s, stop_early) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        if engine_process:
            from prefixkv.engine_core.client import EngineCoreClient

            threads = engine_threads or process.engine_threads(process.available_cpus())
            engine: EngineClient = EngineCoreClient.launch(engine_config, threads=threads)
        else:
            from prefixkv.async_engine import AsyncEngine
            from prefixkv.engine import LLMEngine

            engine = AsyncEngine(LLMEngine(engine_config))
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return run_event_loop(serve(engine, config, host, port))


def run_event_loop(main: Coroutine[Any, Any, int]) -> int:
    """Run an HTTP process's ``main`` on uvloop's event loop where uvloop is installed (the server
    extra installs it on Linux and macOS: libuv's loop and transports cost less CPU per streamed
    event than asyncio's), on asyncio's otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


async def serve(engine: EngineClient, config: ServerConfig, host: str, port: int, sock: socket.socket | None = None,
                on_ready: Callable[[str], None] | None = None,
                signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> int:
    """Serve ``engine`` on ``host:port`` (or the listening ``sock``, shared with other processes)
    until one of ``signals`` (0) or the engine's death (1). ``on_ready(url)`` once it listens
    (default: print the "prefixkv serving" line)."""
    app = create_app(engine, config)
    try:
        runner, bound = await start_site(app, host, port, sock)
    except OSError as e:
        print(f"prefixkv: error: cannot listen on {host}:{port}: {e}", file=sys.stderr)
        await engine.shutdown()
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for s in signals:
        loop.add_signal_handler(s, stop.set)
    logger.info("HTTP process %d: %d start-up objects frozen out of the garbage collector's walks; "
                "young-generation threshold %d", os.getpid(), tune_gc_for_serving(), GC_YOUNG_THRESHOLD)
    url = url_for(host, bound)
    if on_ready is None:
        print(f"prefixkv serving {config.model_name} at {url}", flush=True)
    else:
        on_ready(url)
    while not stop.is_set() and engine.fatal_error is None:  # a dead engine ends the process
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=0.2)
    if engine.fatal_error is not None:
        logger.critical("the engine is dead: %s; exiting with status 1", engine.fatal_error)
        await asyncio.sleep(0.5)  # /health answers 503 meanwhile; in-flight requests got the error
    else:
        logger.info("shutting down: no new connections; aborting in-flight requests")
    await runner.cleanup()  # stop listening -> on_shutdown (engine.shutdown) -> wait for handlers
    return 1 if engine.fatal_error is not None else 0


@dataclass
class BackgroundServer:
    """The server on its own event loop in a daemon thread (tests, notebooks, benchmarks)::

        with BackgroundServer(AsyncEngine(engine), ServerConfig("m")) as srv:
            openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
    """

    engine: EngineClient
    config: ServerConfig
    host: str = "127.0.0.1"
    port: int = 0
    _thread: threading.Thread | None = field(default=None, repr=False)
    _loop: asyncio.AbstractEventLoop | None = field(default=None, repr=False)
    _ready: threading.Event = field(default_factory=threading.Event, repr=False)
    _error: BaseException | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return url_for(self.host, self.port)

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self._thread = threading.Thread(target=self._main, name="prefixkv-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the server did not start")
        if self._error is not None:
            raise self._error
        return self

    def stop(self, timeout: float = 30.0) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _main(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        try:
            runner, self.port = loop.run_until_complete(start_site(create_app(self.engine, self.config),
                                                                   self.host, self.port))
        except BaseException as e:
            self._error = e
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(runner.cleanup())
            loop.close()
