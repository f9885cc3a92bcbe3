"""The aiohttp transport of the OpenAI-compatible server: routes, body limits, the API key,
OpenAI-shaped errors for aiohttp's own 404/405/413, SSE writing and client disconnects. The API
itself (parsing, templates, sampling parameters, engine calls, wire formats) is
``server/serving.py``, which knows no HTTP library.

Routes: POST /v1/chat/completions, POST /v1/completions, POST /v1/responses, GET and DELETE
/v1/responses/{id}, POST /v1/messages[/count_tokens] (Anthropic's), GET /v1/models[/{model}], GET /health,
GET /metrics, POST /tokenize, POST /detokenize, GET /version, and the browser pages
(``server/webui.py``: GET /, GET /cache, GET /v1/cache/summary). A client that disconnects cancels
its handler, which closes its stream, which aborts its requests in the engine (their KV blocks are
freed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from prefixkv.async_engine import AsyncEngine
from prefixkv.server.protocol import ProtocolError
from prefixkv.server.serving import (  # noqa: F401 - ServerConfig and ApiError are this module's API too
    ApiError,
    OpenAIServing,
    Reply,
    ServerConfig,
    bad_request,
    timeout_at,
)
from prefixkv.server.webui import WebUI

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



def _response(reply: Reply) -> web.Response:
    return web.Response(status=reply.status, body=reply.body,
                        headers={**(reply.headers or {}), "Content-Type": reply.content_type})


class _AioServer:
    """aiohttp handlers over ``OpenAIServing``."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig) -> None:
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
        if self.api.needs_key(request.path):
            self.api.check_key(request.headers.get("Authorization"), request.headers.get("x-api-key"))
        return await handler(request)

    # ------------------------------------------------------------------ transport
    async def _body(self, request: web.Request, t0: float) -> bytes:
        limit = self.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise ApiError(413, f"the request body ({request.content_length} bytes) is larger than the "
                                f"server's limit of {limit} bytes", code="request_too_large")
        try:  # the request timeout counts from arrival, so a body that trickles in is cut off too
            async with timeout_at(t0 + self.config.request_timeout):
                return await request.read()  # aiohttp raises 413 past client_max_size (chunked bodies)
        except TimeoutError:
            raise ApiError(408, "the request body did not arrive within the request timeout",
                           code="request_timeout") from None

    async def _send(self, request: web.Request, reply: Reply) -> web.StreamResponse:
        if reply.stream is None:
            return _response(reply)
        try:
            resp = web.StreamResponse(status=reply.status, headers=reply.headers)
            await resp.prepare(request)
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
        return _response(self.api.responses.delete(request.match_info["response_id"]))

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


SERVER_KEY = web.AppKey("prefixkv_server", _AioServer)


def create_app(engine: AsyncEngine, config: ServerConfig) -> web.Application:
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
    WebUI(engine, config.model_name, config.cache_view_text).add_routes(app)

    async def on_shutdown(app: web.Application) -> None:
        await engine.shutdown()
        server.api._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    app.on_shutdown.append(on_shutdown)
    return app


async def start_site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Bind ``app`` (port 0 = any free port); returns the runner and the bound port."""
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its request.
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=10.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
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


def default_model_name(model: str | None) -> str:
    if model is None:
        from prefixkv.model.loader import EMBEDDED_NAME

        return EMBEDDED_NAME
    path = Path(model).expanduser()
    return path.stem if path.suffix == ".gguf" else path.name


def _none_word(value: str | None) -> str | None:
    return None if value == "none" else value


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(model_name=args.served_model_name or default_model_name(args.model),
                        api_key=args.api_key or os.environ.get("PREFIXKV_API_KEY") or None,
                        max_body_bytes=args.max_body_bytes, request_timeout=args.request_timeout,
                        tool_call_parser=_none_word(getattr(args, "tool_call_parser", None)),
                        reasoning_parser=getattr(args, "reasoning_parser", None),
                        max_stored_responses=getattr(args, "max_stored_responses", 1000),
                        max_stored_response_bytes=getattr(args, "max_stored_response_bytes", 64 << 20),
                        cache_view_text=getattr(args, "cache_view_text", False))


def run_server(args: argparse.Namespace) -> int:
    """``prefixkv serve``: load the model, serve until SIGTERM/SIGINT, exit 0 after a graceful stop."""
    from prefixkv.engine_args import engine_config_from_args
    from prefixkv.engine import LLMEngine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    config = server_config_from_args(args)
    stop_early = lambda signum, frame: sys.exit(0)  # noqa: E731 - a signal while the model loads
    old = {s: signal.signal(s, stop_early) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        engine = LLMEngine(engine_config_from_args(args))
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return asyncio.run(_serve(AsyncEngine(engine), config, args.host, args.port))


# Container allocations between young collections (CPython's default: 700). A step allocates a few
# objects per running request (scheduled entries, outputs, deltas): with 700, most of them were
# alive at a collection, were promoted and fed full collections; `bench scale` at 256 running:
# median host step 1.02 -> 0.91 ms, no full collection in 100 steps instead of one per ~70.
GC_YOUNG_THRESHOLD = 20_000


def tune_gc_for_serving() -> int:
    """Once the serving process has started: move everything alive (torch, transformers, the
    model, the server: ~2e5 objects) out of the garbage collector's reach, as vLLM's engine core
    does (none of it is garbage, and each full collection walked it all: 0.1 s a pause here), and
    collect the young generation less often (``GC_YOUNG_THRESHOLD``). Done by ``prefixkv serve``
    only: the offline ``LLM`` lives in its caller's process, whose heap is the caller's. Returns
    the number of objects frozen."""
    gc.collect()
    gc.freeze()
    _, g1, g2 = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, g1, g2)
    return gc.get_freeze_count()


async def _serve(engine: AsyncEngine, config: ServerConfig, host: str, port: int) -> int:
    app = create_app(engine, config)
    try:
        runner, bound = await start_site(app, host, port)
    except OSError as e:
        print(f"prefixkv: error: cannot listen on {host}:{port}: {e}", file=sys.stderr)
        await engine.shutdown()
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for s in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(s, stop.set)
    logger.info("%d start-up objects frozen out of the garbage collector's walks; young-generation "
                "threshold %d", tune_gc_for_serving(), GC_YOUNG_THRESHOLD)
    print(f"prefixkv serving {config.model_name} at {url_for(host, bound)}", flush=True)
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

    engine: AsyncEngine
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
