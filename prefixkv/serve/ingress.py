"""The HTTP ingress of the Ray Serve application: the OpenAI layer (server/serving.py, the same one
the single-process aiohttp server adapts) over a ``RemoteEngine`` whose requests run on the engine
replicas, behind Serve's HTTP proxy (Starlette requests in, Starlette responses out).

The ingress renders chat templates and tokenizes (it loads the tokenizer, not the model), validates
grammars, and hands each prompt's token ids to a replica chosen by the deployment's request router
(serve/router.py). Routes, request and error bodies, SSE streams and the API key are the aiohttp
server's; ``/health`` and ``/metrics`` cover every replica (``replica`` labels); the browser pages
are served too, ``/v1/cache/summary`` showing one replica's cache (``?replica=ID``) from the summary
its digest carried. A client that goes away closes its stream, which cancels the replica call, which
aborts the request there. What the ingress asks of every replica (a deleted stored Response's
retention to release, ``POST /reset_prefix_cache``) goes through the application's control log
(serve/control_log.py).
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

import msgspec
from ray.exceptions import RayError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, Response, StreamingResponse

from prefixkv.config import RuntimeInfo
from prefixkv.errors import EngineDeadError, ReplicaDiedError, RequestAbortedError, RequestFailedError
from prefixkv.sampling_params import SamplingParams
from prefixkv.serve.control_log import ControlLog, log_name
from prefixkv.serve.registry import routers_for
from prefixkv.serve.replica import LOOKUP_EVERY, SUMMARY_NODES, ReplicaRequest, serve_context
from prefixkv.server.cache_view import parse_max_nodes, summary_payload, trim_tree
from prefixkv.server.metrics import ReplicaCollector
from prefixkv.server.pages import PAGE_HEADERS, PAGES, STATIC_DIR, static_file
from prefixkv.server.protocol import ProtocolError
from prefixkv.server.serving import ApiError, OpenAIServing, Reply, ServerConfig, bad_request, read_body

logger = logging.getLogger(__name__)

# POST /reset_prefix_cache with replicas: how long the ingress waits for every replica's report, at
# least (a routing-stats period once the replicas have found the control log; up to LOOKUP_EVERY
# periods before: OpenAIIngress waits that long and more), and how often it looks
RESET_TIMEOUT_S = 30.0
RESET_POLL_S = 0.1


def _raise_item(item: tuple, replica_id: str | None) -> None:
    """A replica's ("error", kind, message) as the exception the single-process engine raises,
    except that an engine that died or shut down is that replica's, not the service's."""
    _, kind, message = item
    if kind == "invalid":
        raise ValueError(message)
    if kind == "overloaded":
        raise OverflowError(message)
    if kind in ("dead", "fatal"):
        raise ReplicaDiedError(f"the engine of replica {replica_id} stopped ({message}); retry the request")
    if kind == "aborted":
        raise RequestAbortedError(message)
    raise RequestFailedError(message)


class RemoteStream:
    """One request's ``RequestOutput`` deltas from its replica (an ``OutputStream``)."""

    def __init__(self, request_id: str, gen: Any, replica_id: str) -> None:
        self.request_id = request_id
        self._gen = gen
        self.replica_id = replica_id
        self._done = False

    @property
    def done(self) -> bool:
        return self._done

    def __aiter__(self) -> RemoteStream:
        return self

    async def __anext__(self):
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._gen.__anext__()
        except StopAsyncIteration:
            self._done = True
            raise
        except RayError as e:  # the replica's actor died (or its node): Serve replaces it
            self._done = True
            raise ReplicaDiedError(f"the engine replica {self.replica_id} serving this request died; the request "
                                   f"was lost ({type(e).__name__}); retry it") from None
        if isinstance(item, tuple):
            self._done = True
            _raise_item(item, self.replica_id)
        if item.finished:
            self._done = True
        return item

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self._gen.cancel()


def _load_stats(routing_stats: dict[str, Any]) -> dict[str, float]:
    load = routing_stats.get("load") or {}
    return {k: load.get(k) or 0 for k in ("num_prefill_tokens", "prefill_tokens_per_s", "decode_step_s")}


class RemoteEngine:
    """An ``EngineClient`` (prefixkv/engine_client.py) over the replicas' deployment handle. A
    replica that dies ends its own requests (``ReplicaDiedError``); the service itself never has a
    ``fatal_error`` (Serve replaces the replica)."""

    fatal_error: BaseException | None = None

    def __init__(self, handle: Any, facts: dict[str, Any], tokenizer: Any, deployment: str,
                 app_name: str = "local", log: Any = None, reset_timeout_s: float = RESET_TIMEOUT_S) -> None:
        from prefixkv.structured_outputs import GrammarCompiler

        self.handle = handle.options(stream=True)
        self.tokenizer = tokenizer
        self.info = RuntimeInfo(num_kv_blocks=facts["num_kv_blocks"], max_model_len=facts["max_model_len"],
                                eos_token_ids=facts["eos_token_ids"], vocab_size=facts["vocab_size"])
        self.max_waiting_requests = facts["max_waiting_requests"]
        self.default_sampling = facts["default_sampling"]
        self.deployment = deployment
        self.app_name = app_name
        self._grammars = GrammarCompiler(tokenizer, facts["vocab_size"])
        self._log = log  # the application's ControlLog actor (or made at its first use)
        self.reset_timeout_s = reset_timeout_s

    def compile_grammar(self, structured_outputs: Any) -> None:
        """Validates here (a 400 before routing); the replica compiles it again into its own cache."""
        self._grammars.compile(structured_outputs)

    def published(self) -> dict[str, dict[str, Any]]:
        """replica id -> its routing stats (digest, engine statistics, cache summary) as last
        published to this process's router."""
        out: dict[str, dict[str, Any]] = {}
        for router in routers_for(self.deployment):
            in_flight = router.in_flight()
            for rid, rs in router.routing_stats().items():
                if "stats" in rs:
                    out[rid] = {**rs, "num_routed": router.routed[rid], "num_in_flight": in_flight.get(rid, 0)}
        return out

    def replica_stats(self) -> dict[str, dict[str, Any]]:
        """replica id -> engine statistics, with the size of its cache digest, the digest's sequence
        number, how many requests the router sent it and counts against it now, and its published
        load (serve/load.py; speeds 0 until measured)."""
        return {rid: {**rs["stats"], "num_cached_blocks": len(rs.get("digest") or ()), "digest_seq": rs.get("seq", 0),
                      "num_routed": rs["num_routed"], "num_in_flight": rs["num_in_flight"], **_load_stats(rs)}
                for rid, rs in self.published().items()}

    def cache_views(self) -> dict[str, dict[str, Any]]:
        """replica id -> the router's event-fed view of its cache (``--routing-cache-view events``)."""
        out: dict[str, dict[str, Any]] = {}
        for router in routers_for(self.deployment):
            out.update(router.cache_views())
        return out

    def router_decisions(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for router in routers_for(self.deployment):
            for reason, n in router.decisions.items():
                total[reason] = total.get(reason, 0) + n
        return total

    def stats(self) -> dict[str, Any]:
        """The replicas' engine statistics, summed."""
        total: dict[str, Any] = {}
        for rs in self.published().values():
            for k, v in rs["stats"].items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    total[k] = total.get(k, 0) + v
        return total

    @property
    def is_running(self) -> bool:
        stats = self.replica_stats()
        return not stats or any(s.get("running", True) for s in stats.values())

    def replica_summary(self, replica: str | None, max_nodes: int) -> tuple[str, dict[str, Any], list[str]]:
        """(replica id, its cache summary cut to ``max_nodes``, every replica with a summary): the
        summary that ``replica`` (default: the one caching the most) published with its last digest
        (at most ``SUMMARY_NODES`` nodes, with text as the replicas were started). ``EngineDeadError``
        before any replica has published one, ``LookupError(replica, replicas)`` for one without."""
        published = {rid: rs for rid, rs in self.published().items() if rs.get("cache_summary")}
        if not published:
            raise EngineDeadError("no replica has published its cache yet")
        rid = replica or max(published, key=lambda r: len(published[r].get("digest") or ()))
        if rid not in published:
            raise LookupError(rid, sorted(published))
        summary = dict(published[rid]["cache_summary"])
        summary["tree"] = trim_tree(summary["tree"], max_nodes)
        return rid, summary, sorted(published)

    async def cache_summary(self, max_nodes: int, text_tokens: int = 0) -> dict[str, Any]:
        return self.replica_summary(None, max_nodes)[1]

    async def release_retention(self, handle: str) -> bool:
        """Log ``handle`` for the replicas to release (serve/control_log.py). True once logged (which
        replica holds it is not known here); False outside a Serve application (an ingress driven
        in-process: no replica to tell)."""
        import ray

        if self.app_name == "local" or not ray.is_initialized():
            return False
        await self._logged("append", [handle])
        return True

    async def reset_prefix_cache(self) -> bool:
        """``POST /reset_prefix_cache``: a reset asked in the control log (serve/control_log.py) of
        the replicas the router knows (those that published routing stats and run); each resets its
        engine's prefix cache in its next routing-stats period and reports. True when every one has
        reset; False when one refused, a request running or waiting there (the others have reset).
        A replica that leaves or stops running meanwhile is not waited for. ``TimeoutError`` when
        no replica has published yet, when one did not report within ``reset_timeout_s``, or when
        the control log failed; ``NotImplementedError`` outside a Serve application."""
        import ray
        from ray.exceptions import RayError

        if self.app_name == "local" or not ray.is_initialized():
            raise NotImplementedError("POST /reset_prefix_cache: no Serve application, no replica to reset")
        replicas = self._running_replicas()
        if not replicas:
            raise TimeoutError("no engine replica has published its routing stats yet")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.reset_timeout_s
        try:
            log_id, number = await self._logged("ask_reset", sorted(replicas))
            while True:
                reports = await self._logged("reset_reports", log_id, number)
                if reports is None:
                    raise TimeoutError("the control log was made anew while the replicas answered (its owner "
                                       "was gone): ask again")
                replicas &= self._running_replicas()  # (one gone or dead meanwhile: not waited for)
                missing = replicas - set(reports)
                if not missing:
                    return all(reports[rid] for rid in replicas)
                if loop.time() > deadline:
                    raise TimeoutError(f"replica(s) {', '.join(sorted(missing))} did not report the prefix "
                                       f"cache's reset within {self.reset_timeout_s:g} s (the others have answered)")
                await asyncio.sleep(RESET_POLL_S)
        except RayError as e:
            raise TimeoutError(f"the control log failed: {type(e).__name__}: {e}") from None

    def _running_replicas(self) -> set[str]:
        return {rid for rid, s in self.replica_stats().items() if s.get("running", True)}

    async def _logged(self, method: str, *args: Any) -> Any:
        """``method(*args)`` of the application's control log; once more on a new log if its owner
        (another ingress replica) is gone."""
        from ray.exceptions import RayActorError

        if self._log is None:  # (a lookup in Ray's control store: off the event loop)
            self._log = await asyncio.to_thread(control_log, self.app_name)
        try:
            return await getattr(self._log, method).remote(*args)
        except RayActorError:
            self._log = await asyncio.to_thread(control_log, self.app_name)
            return await getattr(self._log, method).remote(*args)

    async def start(self) -> None:
        """Nothing to open: the deployment handle is Serve's."""

    async def shutdown(self) -> None:
        """Nothing to stop here: Serve owns the replicas."""

    async def add_requests(self, requests: list[tuple[str, list[int]]], params: SamplingParams) -> list[RemoteStream]:
        streams: list[RemoteStream] = []
        try:
            for request_id, ids in requests:
                if isinstance(ids, str):
                    raise ValueError("prompt: the ingress hands replicas token ids only")
                gen = self.handle.generate.remote(ReplicaRequest(request_id, list(ids), params))
                try:
                    first = await gen.__anext__()
                except RayError as e:
                    raise ReplicaDiedError(f"the engine replica chosen for this request failed before it started "
                                           f"({type(e).__name__}); retry it") from None
                if first[0] != "accepted":
                    _raise_item(first, None)
                streams.append(RemoteStream(request_id, gen, first[1]))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return streams


_ROUTES: dict[tuple[str, str], str] = {
    ("POST", "/v1/chat/completions"): "chat_completions",
    ("POST", "/v1/completions"): "completions",
    ("POST", "/v1/responses"): "responses",
    ("POST", "/v1/messages"): "messages",
    ("POST", "/v1/messages/count_tokens"): "count_tokens",
    ("GET", "/v1/models"): "models",
    ("GET", "/health"): "health",
    ("POST", "/tokenize"): "tokenize",
    ("POST", "/detokenize"): "detokenize",
    ("GET", "/version"): "version",
    ("GET", "/metrics"): "metrics",
    ("GET", "/v1/cache/summary"): "cache_summary",
    ("POST", "/reset_prefix_cache"): "reset_prefix_cache",
    **{("GET", page): "page" for page in PAGES},
}
_MODEL_ROUTE = re.compile(r"/v1/models/(?P<model>[^/]+)")
_RESPONSE_ROUTE = re.compile(r"/v1/responses/(?P<id>[^/]+)")


def control_log(app_name: str) -> Any:
    """Application ``app_name``'s ControlLog actor, created if there is none (owned by the ingress
    replica that creates it; no CPU of its own: the replicas may hold every one)."""
    import ray

    return ray.remote(ControlLog).options(name=log_name(app_name), get_if_exists=True, num_cpus=0).remote()


def _response(reply: Reply) -> Response:
    headers = dict(reply.headers or {})
    if reply.stream is None:
        return Response(reply.body, status_code=reply.status, headers=headers, media_type=reply.content_type)
    stream = reply.stream

    async def body():
        try:
            async for chunk in stream:
                yield chunk
        finally:  # finished, client gone or cancelled: the replica calls behind it are cancelled
            await stream.aclose()

    headers.pop("Content-Type", None)
    return StreamingResponse(body(), status_code=reply.status, headers=headers, media_type="text/event-stream")


class OpenAIIngress:
    """The ingress deployment class (``serve.deployment(OpenAIIngress)`` in serve/app.py)."""

    def __init__(self, replicas: Any, model_path: str, config: ServerConfig, replica_deployment: str,
                 routing_stats_period_s: float = 1.0) -> None:
        from prefixkv.tokenizer import Tokenizer

        self._replicas = replicas
        self._tokenizer = Tokenizer.from_pretrained(model_path)
        self.config = config
        self._deployment = replica_deployment
        self._app_name = serve_context()[1]
        self._reset_timeout_s = max(RESET_TIMEOUT_S, (LOOKUP_EVERY + 3) * routing_stats_period_s)
        self._log: Any = None  # the control log, made now: the replicas look for it from their start
        if self._app_name != "local":
            try:
                self._log = control_log(self._app_name)
            except Exception as e:  # (made again at its first use)
                logger.warning("the control log (serve/control_log.py): %s: %s", type(e).__name__, e)
        self.api: OpenAIServing | None = None
        self._starting: asyncio.Lock | None = None

    async def _api(self) -> OpenAIServing:
        if self.api is None:
            self._starting = self._starting or asyncio.Lock()
            async with self._starting:
                if self.api is None:
                    facts = await self._replicas.describe.remote()
                    engine = RemoteEngine(self._replicas, facts, self._tokenizer, self._deployment, self._app_name,
                                          self._log, self._reset_timeout_s)
                    api = OpenAIServing(engine, self.config)
                    api.metrics.register(ReplicaCollector(engine.replica_stats, engine.router_decisions))
                    self.api = api
        return self.api

    async def __call__(self, request: Request) -> Response:
        try:
            api = await self._api()
        except Exception as e:  # no replica could answer describe(): not ready
            logger.warning("no engine replica answered: %s", e)
            return _response(ApiError(503, "no engine replica is available yet; retry later", type="server_error",
                                      code="not_ready", headers={"Retry-After": "1"}).reply())
        t0 = asyncio.get_running_loop().time()
        path, method = request.url.path, request.method
        route = path if (method, path) in _ROUTES else ("/v1/models/{model}" if _MODEL_ROUTE.fullmatch(path)
                                                        else "/v1/responses/{response_id}"
                                                        if _RESPONSE_ROUTE.fullmatch(path) else "unmatched")
        try:
            resp = await self._route(api, request, t0)
        except ApiError as e:
            resp = _response(api.error_reply(e, path))
        except ProtocolError as e:
            resp = _response(api.error_reply(bad_request(e), path))
        except ClientDisconnect:
            resp = Response(status_code=499)
        except Exception:
            logger.exception("unhandled error in %s %s", method, path)
            resp = _response(api.error_reply(ApiError(500, "internal server error", type="server_error",
                                                      code="internal_error"), path))
        api.metrics.requests.labels(route, str(resp.status_code)).inc()
        return resp

    async def _route(self, api: OpenAIServing, request: Request, t0: float) -> Response:
        path, method = request.url.path, request.method
        api.authenticate(path, request.headers.get("authorization"), request.headers.get("x-api-key"))
        name = _ROUTES.get((method, path))
        model = _MODEL_ROUTE.fullmatch(path)
        if name is None and model is not None and method == "GET":
            return _response(api.model(model.group("model")))
        stored = _RESPONSE_ROUTE.fullmatch(path)
        if name is None and stored is not None and method in ("GET", "DELETE"):
            if method == "GET":
                return _response(api.responses.get(stored.group("id")))
            return _response(await api.responses.delete(stored.group("id")))
        if name is None and path.startswith("/static/") and method == "GET":
            f = static_file(path[len("/static/"):])
            if f is None:
                raise ApiError(404, f"Not Found: {method} {path}", code="not_found")
            return FileResponse(f, headers=PAGE_HEADERS)
        if name == "page":
            return FileResponse(STATIC_DIR / PAGES[path], headers=PAGE_HEADERS)
        if name == "cache_summary":
            return _response(self._cache_summary(api, request.query_params))
        if name is None:
            allowed = sorted(m for m, p in _ROUTES if p == path) or (["GET"] if model is not None else
                                                                     ["DELETE", "GET"] if stored is not None else [])
            if allowed:
                raise ApiError(405, f"Method Not Allowed: {method} {path} (allowed: {', '.join(allowed)})",
                               code="method_not_allowed", headers={"Allow": ", ".join(allowed)})
            raise ApiError(404, f"Not Found: {method} {path}", code="not_found")
        if name == "health":
            return _response(self._health(api))
        if name == "metrics":
            return _response(api.metrics_reply())
        if name in ("models", "version"):
            return _response(getattr(api, name)())
        if name == "reset_prefix_cache":
            return _response(await api.reset_prefix_cache(request.query_params))
        body = await self._body(request, t0)
        if name in ("chat_completions", "completions"):
            return _response(await getattr(api, name)(body, t0))
        if name == "responses":
            return _response(await api.responses.create(body, t0))
        if name == "messages":
            return _response(await api.messages.create(body, t0))
        if name == "count_tokens":
            return _response(await api.messages.count_tokens(body))
        return _response(await getattr(api, name)(body))

    async def _body(self, request: Request, t0: float) -> bytes:
        length = request.headers.get("content-length")
        return await read_body(request.stream(), int(length) if length is not None and length.isdigit() else None,
                               self.config.max_body_bytes, t0 + self.config.request_timeout)

    def _cache_summary(self, api: OpenAIServing, query: Any) -> Reply:
        """``/v1/cache/summary`` for one replica (``?replica=ID``; default the one caching the most),
        from the summary its last digest carried (at most ``SUMMARY_NODES`` nodes)."""
        max_nodes = parse_max_nodes(query.get("max_nodes"), SUMMARY_NODES)
        try:
            rid, summary, replicas = api.engine.replica_summary(query.get("replica"), max_nodes)
        except EngineDeadError as e:
            raise ApiError(503, str(e), type="server_error", code="not_ready") from None
        except LookupError as e:
            rid, running = e.args
            raise ApiError(404, f"replica: {rid!r} is not a running replica (running: {', '.join(running)})",
                           param="replica", code="replica_not_found") from None
        body = summary_payload(summary, self.config.model_name, self.config.cache_view_text)
        body["replica"], body["replicas"] = rid, replicas
        return Reply(200, msgspec.json.encode(body), headers={"Cache-Control": "no-store"})

    def _health(self, api: OpenAIServing) -> Reply:
        """200 while at least one replica runs (503 before the first one has published its routing
        stats, or when none is left); the body lists every replica the router sees, with the size
        and sequence number of its last published cache digest, where it publishes KV events
        (``kv_events``: endpoint, replay endpoint, hash algorithm) and, with
        ``--routing-cache-view events``, the router's view fed by them (``cache_view``)."""
        stats = api.engine.replica_stats()
        published, views = api.engine.published(), api.engine.cache_views()
        replicas = {rid: {"status": "ok" if s.get("running", True) else "unavailable",
                          "cached_blocks": s["num_cached_blocks"], "digest_seq": s["digest_seq"]}
                    for rid, s in sorted(stats.items())}
        for rid, r in replicas.items():
            if published.get(rid, {}).get("kv_events"):
                r["kv_events"] = published[rid]["kv_events"]
            if rid in views:
                r["cache_view"] = views[rid]
        ok = any(r["status"] == "ok" for r in replicas.values())
        body = {"status": "ok" if ok else "unavailable", "replicas": replicas}
        return Reply(200 if ok else 503, msgspec.json.encode(body))

