"""OpenAI-compatible HTTP server (aiohttp) over ``AsyncEngine``.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models[/{model}], GET /health,
GET /metrics. Streaming is SSE (``data: {json}\\n\\n`` ... ``data: [DONE]\\n\\n``).

One request, start to end::

    body (<= max_body_bytes, else 413) -> msgspec decode (400 + field path) -> model check (404)
    -> SamplingParams (400, param = the field) -> [chat template on the engine thread]
    -> AsyncEngine.add_request (400 prompt too long, 503 queue full)      <- nothing sent yet
    -> JSON response | SSE stream                                          <- 200 from here on
    any exit before the last token (client disconnect, timeout, shutdown) aborts the request in the
    engine, which frees its KV blocks.

Errors are OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}``, for aiohttp's own
404/405/413 too. Bad input never yields a 500.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import gc
import hmac
import logging
import os
import re
import signal
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import msgspec
from aiohttp import web

from prefixkv.async_engine import AsyncEngine, RequestAbortedError, RequestStream
from prefixkv.errors import EngineDeadError, EngineFatalError
from prefixkv.outputs import CompletionOutput, RequestOutput, TokenLogprob
from prefixkv.sampling_params import SamplingParams
from prefixkv.server.metrics import ServerMetrics
from prefixkv.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorBody,
    ErrorResponse,
    FunctionCall,
    ModelCard,
    ModelList,
    ProtocolError,
    TokenizeRequest,
    TokenizeResponse,
    TokenText,
    ToolCallOut,
    Usage,
    VersionResponse,
    chat_logprobs,
    completion_logprobs,
    decode_request,
    encode,
    make_usage,
    prompt_list,
    prompt_logprobs_wire,
)
from prefixkv.server.tools import PARSERS, ToolPlan, ToolStream, plan_tools
from prefixkv.server.webui import WebUI

logger = logging.getLogger(__name__)

_PARAM = re.compile(r"[A-Za-z_][\w.\[\]]*")
# aiohttp >= 3.11 wants typed request keys; older versions have only str keys
_STATUS_KEY: Any = web.RequestKey("prefixkv_status", int) if hasattr(web, "RequestKey") else "prefixkv_status"
# nginx's code for "client closed the request"; only ever used as a metrics label
_CLIENT_CLOSED = 499
_SSE_DONE = b"data: [DONE]\n\n"

if sys.version_info >= (3, 11):
    _timeout_at = asyncio.timeout_at
else:  # Python 3.10: the same contract, without Task.uncancel
    @contextlib.asynccontextmanager
    async def _timeout_at(when: float):
        task = asyncio.current_task()
        fired = False

        def fire() -> None:
            nonlocal fired
            fired = True
            task.cancel()

        handle = asyncio.get_running_loop().call_at(when, fire)
        try:
            yield
        except asyncio.CancelledError:
            if fired:
                raise TimeoutError from None
            raise
        finally:
            handle.cancel()


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    request_timeout: float = 600.0  # seconds from arrival until the request is aborted
    tool_call_parser: str | None = None  # "hermes" | "llama3_json": tool_choice "auto" (server/tools.py)
    cache_view_text: bool = False  # /v1/cache/summary (the /cache page) may show the cached runs' text

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser: must be one of {', '.join(PARSERS)}, got {self.tool_call_parser!r}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes: must be positive, got {self.max_body_bytes}")
        if not self.request_timeout > 0:
            raise ValueError(f"request_timeout: must be positive, got {self.request_timeout}")


# ---------------------------------------------------------------------- errors
class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> ErrorResponse:
        return ErrorResponse(ErrorBody(self.message, self.type, self.param, self.code))

    def response(self) -> web.Response:
        return web.Response(status=self.status, body=encode(self.body()), content_type="application/json",
                            headers=self.headers)


def bad_request(e: ValueError, aliases: dict[str, str] | None = None) -> ApiError:
    """400 from a ``ValueError("field: message")``: param is the field (renamed through ``aliases``)."""
    if isinstance(e, ProtocolError):
        return ApiError(400, e.message, param=e.param)
    msg = str(e)
    head, sep, rest = msg.partition(": ")
    param = head if sep and _PARAM.fullmatch(head) else None
    if param and aliases and param in aliases:  # a whole path renamed
        param = aliases[param]
        msg = f"{param}: {rest}"
    elif param and aliases:
        root = re.split(r"[.\[]", param, maxsplit=1)[0]
        if root in aliases:  # name the field the client sent, in the message too
            param = aliases[root] + param[len(root):]
            msg = f"{param}: {rest}"
    return ApiError(400, msg, param=param)


def _engine_error(e: BaseException) -> ApiError:
    if isinstance(e, TimeoutError):
        return ApiError(504, "the request took longer than the server's request timeout and was aborted",
                        type="server_error", code="request_timeout")
    if isinstance(e, EngineFatalError):
        return ApiError(503, f"the engine is dead and the server is exiting: {e}", type="server_error",
                        code="engine_dead")
    if isinstance(e, EngineDeadError):
        return ApiError(503, "the server is shutting down", type="server_error", code="shutting_down")
    if isinstance(e, RequestAbortedError):
        return ApiError(503, str(e), type="server_error", code="aborted")
    logger.error("request failed in the engine", exc_info=e)
    return ApiError(500, f"internal error in the engine: {type(e).__name__}: {e}", type="server_error",
                    code="internal_error")


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


# ---------------------------------------------------------------------- token texts for logprobs
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenTexts:
    """token id -> (text, raw bytes) of that token alone, cached. Byte-level BPE pieces map back to
    their exact bytes (a piece can be part of a UTF-8 character); sentencepiece byte pieces
    ``<0xNN>`` to that byte. Uses only read-only tokenizer lookups."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}
        decoder = getattr(getattr(getattr(tokenizer, "hf", None), "backend_tokenizer", None), "decoder", None)
        self._byte_level = ({c: b for b, c in _bytes_to_unicode().items()}
                            if type(decoder).__name__ == "ByteLevel" else None)

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            raw = self._raw(token_id)
            hit = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), raw)
        return hit

    def _raw(self, token_id: int) -> bytes:
        piece = self._tok.convert_ids_to_tokens([token_id])[0] or ""
        if self._byte_level is not None and piece and all(c in self._byte_level for c in piece):
            return bytes(self._byte_level[c] for c in piece)
        m = _BYTE_PIECE.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        if "\u2581" in piece:  # sentencepiece word boundary
            return piece.replace("\u2581", " ").encode()
        return self._tok.decode([token_id], skip_special_tokens=False).encode()


# ---------------------------------------------------------------------- response formats
@dataclass
class _ChoiceState:
    num_sent_chars: int = 0
    finished: bool = False


@dataclass
class _Format:
    """One endpoint's wire objects (stream chunks, the full response) built from engine outputs.
    A subclass gives the object types, the choice shapes and the logprobs format."""

    id_prefix: ClassVar[str]
    chunk_type: ClassVar[type]
    response_type: ClassVar[type]
    # (index, text, logprobs, finish_reason, stop_reason) -> one choice of a response / of a stream chunk
    _choice: ClassVar[Callable[..., msgspec.Struct]]
    _delta_choice: ClassVar[Callable[..., msgspec.Struct]]
    id: str
    created: int
    model: str
    num_top_logprobs: int
    token_text: TokenText

    def start_chunks(self, num_choices: int) -> list[msgspec.Struct]:
        return []

    def delta_chunk(self, index: int, text: str, lps: list[TokenLogprob] | None, text_offset: int,
                    finish_reason: str | None, stop_reason: int | str | None = None) -> msgspec.Struct:
        choice = self._delta_choice(index, text, self._logprobs_or_none(lps, text_offset), finish_reason, stop_reason)
        return self.chunk_type(self.id, self.created, self.model, [choice])

    def usage_chunk(self, usage: Usage) -> msgspec.Struct:
        return self.chunk_type(self.id, self.created, self.model, [], usage)

    def response(self, choices: list[tuple[int, CompletionOutput]], usage: Usage) -> msgspec.Struct:
        out = [self._choice(index, co.text, self._logprobs_or_none(co.token_logprobs, 0), co.finish_reason, co.stop_reason)
               for index, co in choices]
        return self.response_type(self.id, self.created, self.model, out, usage)

    def _logprobs_or_none(self, lps: list[TokenLogprob] | None, text_offset: int) -> msgspec.Struct | None:
        return None if lps is None else self._logprobs(lps, text_offset)

    def _logprobs(self, lps: list[TokenLogprob], text_offset: int) -> msgspec.Struct:
        raise NotImplementedError


@dataclass
class _ChatFormat(_Format):
    id_prefix = "chatcmpl"
    chunk_type = ChatCompletionChunk
    response_type = ChatCompletionResponse
    tools: ToolPlan | None = None  # the reply holds tool calls (server/tools.py)
    _tool_streams: dict[int, ToolStream] = field(default_factory=dict)  # choice index -> its stream

    def response(self, choices: list[tuple[int, CompletionOutput]], usage: Usage) -> msgspec.Struct:
        if self.tools is None:
            return super().response(choices, usage)
        out = []
        for index, co in choices:
            stream = self.tools.stream()
            stream.feed(co.text)
            stream.close()
            calls = [ToolCallOut(c.id, FunctionCall(c.name, c.arguments)) for c in stream.calls] or None
            finish = self.tools.calls_finish_reason if calls and co.finish_reason == "stop" else co.finish_reason
            out.append(ChatChoice(index, ChatMessageOut("assistant", stream.content, calls),
                                  self._logprobs_or_none(co.token_logprobs, 0), finish, co.stop_reason))
        return self.response_type(self.id, self.created, self.model, out, usage)

    def delta_chunk(self, index: int, text: str, lps: list[TokenLogprob] | None, text_offset: int,
                    finish_reason: str | None, stop_reason: int | str | None = None) -> msgspec.Struct:
        if self.tools is None:
            return super().delta_chunk(index, text, lps, text_offset, finish_reason, stop_reason)
        stream = self._tool_streams.setdefault(index, self.tools.stream())
        content, calls = stream.feed(text)
        if finish_reason is not None:
            more, more_calls = stream.close()
            content, calls = content + more, calls + more_calls
            if stream.calls and finish_reason == "stop":
                finish_reason = self.tools.calls_finish_reason
        delta = DeltaMessage(content=content or None, tool_calls=calls or None)
        choice = ChatChunkChoice(index, delta, self._logprobs_or_none(lps, text_offset), finish_reason, stop_reason)
        return self.chunk_type(self.id, self.created, self.model, [choice])

    def start_chunks(self, num_choices: int) -> list[msgspec.Struct]:
        return [self.chunk_type(self.id, self.created, self.model,
                                [ChatChunkChoice(i, DeltaMessage(role="assistant", content=""))])
                for i in range(num_choices)]

    @staticmethod
    def _choice(index: int, text: str, logprobs: ChatLogprobs | None, finish_reason: str | None,
                stop_reason: int | str | None) -> ChatChoice:
        return ChatChoice(index, ChatMessageOut("assistant", text), logprobs, finish_reason, stop_reason)

    @staticmethod
    def _delta_choice(index: int, text: str, logprobs: ChatLogprobs | None, finish_reason: str | None,
                      stop_reason: int | str | None) -> ChatChunkChoice:
        return ChatChunkChoice(index, DeltaMessage(content=text), logprobs, finish_reason, stop_reason)

    def _logprobs(self, lps: list[TokenLogprob], text_offset: int) -> ChatLogprobs:
        return chat_logprobs(lps, self.token_text, self.num_top_logprobs)


class _CompletionFormat(_Format):
    id_prefix = "cmpl"
    chunk_type = response_type = CompletionResponse  # OpenAI streams the response object itself
    _choice = _delta_choice = staticmethod(CompletionChoice)

    def _logprobs(self, lps: list[TokenLogprob], text_offset: int) -> CompletionLogprobs:
        return completion_logprobs(lps, self.token_text, self.num_top_logprobs, text_offset)


def _sse(obj: object) -> bytes:
    return b"data: " + encode(obj) + b"\n\n"


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                q.put_nowait((i, out))
            q.put_nowait((i, None))
        except Exception as e:
            q.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await q.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


def _usage(finals: list[RequestOutput]) -> Usage:
    return make_usage(sum(o.num_prompt_tokens for o in finals), sum(o.num_output_tokens for o in finals),
                      sum(o.num_cached_tokens for o in finals))


# ---------------------------------------------------------------------- the server
class _Server:
    def __init__(self, engine: AsyncEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.metrics = ServerMetrics(engine.stats, config.model_name)
        self.token_text = TokenTexts(engine.engine.tokenizer)
        self.max_model_len = engine.engine.info.max_model_len
        self.created = int(time.time())
        self._expected_auth = f"Bearer {config.api_key}".encode() if config.api_key else None
        # chat templates and tokenization of (possibly huge) prompts: off the engine thread and off
        # the event loop
        self.tokenizer = engine.engine.tokenizer
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefixkv-tokenize")

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

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
                resp = e.response()
            except ProtocolError as e:
                resp = bad_request(e).response()
            except web.HTTPException as e:
                resp = _http_error(e, request).response()
            except asyncio.CancelledError:  # handler_cancellation: the client disconnected
                status = _CLIENT_CLOSED
                raise
            except ConnectionResetError:  # nobody to answer; aiohttp drops the response quietly
                resp = web.Response(status=_CLIENT_CLOSED)
            except Exception:
                logger.exception("unhandled error in %s %s", request.method, request.path)
                resp = ApiError(500, "internal server error", type="server_error", code="internal_error").response()
            status = request.get(_STATUS_KEY, resp.status)
            return resp
        finally:
            self.metrics.requests.labels(route, str(status)).inc()

    @web.middleware
    async def auth_middleware(self, request: web.Request, handler) -> web.StreamResponse:
        if self._expected_auth is not None and (request.path == "/v1" or request.path.startswith("/v1/")
                                                or request.path in ("/tokenize", "/detokenize")):
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, self._expected_auth):
                raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    # ------------------------------------------------------------------ simple routes
    async def health(self, request: web.Request) -> web.Response:
        if not self.engine.is_running:
            return web.json_response({"status": "unavailable"}, status=503)
        return web.json_response({"status": "ok"})

    async def metrics_route(self, request: web.Request) -> web.Response:
        body, content_type = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    def _card(self) -> ModelCard:
        return ModelCard(self.config.model_name, self.created, max_model_len=self.max_model_len)

    async def version(self, request: web.Request) -> web.Response:
        from prefixkv import __version__

        return _json(VersionResponse(__version__))

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize (a prompt, or chat messages through the template)."""
        t0 = asyncio.get_running_loop().time()
        req = decode_request(await self._body(request, t0), TokenizeRequest)
        self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "prompt: give either prompt or messages", param="prompt")
        try:
            if req.messages is not None:
                messages = [msgspec.to_builtins(m) for m in req.messages]
                ids = await self._off_loop(lambda: self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=req.add_generation_prompt))
            else:
                ids = await self._off_loop(lambda: self.tokenizer.encode(req.prompt, req.add_special_tokens))
        except ValueError as e:
            raise bad_request(e) from None
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return _json(TokenizeResponse(len(ids), self.max_model_len, ids, strs))

    async def detokenize(self, request: web.Request) -> web.Response:
        t0 = asyncio.get_running_loop().time()
        req = decode_request(await self._body(request, t0), DetokenizeRequest)
        self._check_model(req.model)
        v = self.engine.engine.info.vocab_size
        bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < v), None)
        if bad is not None:
            raise ApiError(400, f"tokens[{bad}]: {req.tokens[bad]} is not a token id of this model (vocabulary "
                                f"size {v})", param=f"tokens[{bad}]")
        return _json(DetokenizeResponse(await self._off_loop(lambda: self.tokenizer.decode(req.tokens))))

    async def models(self, request: web.Request) -> web.Response:
        return _json(ModelList([self._card()]))

    async def model(self, request: web.Request) -> web.Response:
        self._check_model(request.match_info["model"])
        return _json(self._card())

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.model_name:
            raise ApiError(404, f"model: {name!r} does not exist; this server serves {self.config.model_name!r}",
                           param="model", code="model_not_found")

    async def _body(self, request: web.Request, t0: float) -> bytes:
        limit = self.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise ApiError(413, f"the request body ({request.content_length} bytes) is larger than the "
                                f"server's limit of {limit} bytes", code="request_too_large")
        try:  # the request timeout counts from arrival, so a body that trickles in is cut off too
            async with _timeout_at(t0 + self.config.request_timeout):
                return await request.read()  # aiohttp raises 413 past client_max_size (chunked bodies)
        except TimeoutError:
            raise ApiError(408, "the request body did not arrive within the request timeout",
                           code="request_timeout") from None

    # ------------------------------------------------------------------ generation routes
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        t0 = asyncio.get_running_loop().time()
        req = decode_request(await self._body(request, t0), ChatCompletionRequest)
        self._check_model(req.model)
        if not req.messages:
            raise ApiError(400, "messages: must be a non-empty list", param="messages")
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
        aliases = {"logprobs": "top_logprobs", "prompt": "messages"}
        max_tokens = req.max_tokens
        if req.max_completion_tokens is not None:
            max_tokens = req.max_completion_tokens
            aliases["max_tokens"] = "max_completion_tokens"
        choice = req.tool_choice if isinstance(req.tool_choice, (str, type(None))) else msgspec.to_builtins(req.tool_choice)
        tools = plan_tools(msgspec.to_builtins(req.tools) if req.tools else None, choice, req.parallel_tool_calls,
                           self.config.tool_call_parser)
        params = self._params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None, aliases, tools)
        _check_tool_messages(req.messages)
        messages = [msgspec.to_builtins(m) for m in req.messages]
        try:
            prompt = await self._off_loop(lambda: self.tokenizer.apply_chat_template(
                messages, tools=tools.tools if tools else None, template_kwargs=req.chat_template_kwargs))
        except ValueError as e:
            raise bad_request(e) from None
        return await self._generate(request, t0, _ChatFormat, req, [prompt], params, aliases, tools)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        t0 = asyncio.get_running_loop().time()
        req = decode_request(await self._body(request, t0), CompletionRequest)
        self._check_model(req.model)
        if req.echo:
            raise ApiError(400, "echo: is not supported", param="echo")
        if req.suffix:
            raise ApiError(400, "suffix: is not supported", param="suffix")
        prompts = prompt_list(req.prompt)
        limit = self.engine.engine.config.scheduler.max_waiting_requests
        if len(prompts) > limit:
            raise ApiError(400, f"prompt: a batch of {len(prompts)} prompts is larger than the server's waiting "
                                f"queue ({limit})", param="prompt")
        params = self._params(req, req.max_tokens, req.logprobs, {})
        return await self._generate(request, t0, _CompletionFormat, req, prompts, params, {})

    def _params(self, req: Any, max_tokens: int | None, logprobs: int | None,
                aliases: dict[str, str], tools: ToolPlan | None = None) -> SamplingParams:
        bad = req.unsupported_field()
        if bad is not None:
            raise ApiError(400, f"{bad}: is not supported by this server", param=bad)
        if req.prompt_logprobs is not None and req.stream:
            raise ApiError(400, "prompt_logprobs: is not supported with stream (ask without streaming)",
                           param="prompt_logprobs")
        kw: dict[str, Any] = dict(max_tokens=max_tokens, stop=req.stop, logprobs=logprobs, output_kind="delta")
        so = self._structured_outputs(req, aliases)
        if tools is not None and tools.structured_outputs is not None:  # the reply must be the tool call(s)
            if so is not None:
                name = "response_format" if req.response_format is not None else "structured_outputs"
                raise ApiError(400, f"{name}: cannot be combined with tool_choice 'required' or a named function",
                               param=name)
            so = tools.structured_outputs
            aliases.update(tools.aliases)
        if so is not None:
            kw["structured_outputs"] = so
        if req.logit_bias is not None:
            try:
                kw["logit_bias"] = {int(k): v for k, v in req.logit_bias.items()}
            except ValueError:
                raise ApiError(400, "logit_bias: keys must be token ids (integers as strings)",
                               param="logit_bias") from None
        for name in ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "stop_token_ids", "ignore_eos", "min_tokens", "skip_special_tokens",
                     "allowed_token_ids", "include_stop_str_in_output", "bad_words", "prompt_logprobs"):
            value = getattr(req, name)
            if value is not None:
                kw[name] = value
        for name, value in self.engine.engine.default_sampling.items():  # the model's generation_config.json
            if kw.get(name) is None:
                kw[name] = value
        try:
            return SamplingParams(**kw)
        except ValueError as e:
            raise bad_request(e, aliases) from None

    def _prepare_prompts(self, prompts: list, params: SamplingParams) -> list:
        """Off the event loop and the engine thread: tokenize, and compile the request's grammar
        into the engine's cache (so that adding the request finds it compiled)."""
        if params.structured_outputs is not None:
            self.engine.engine.grammars.compile(params.structured_outputs)
        return [self.tokenizer.encode(p) if isinstance(p, str) and p else p for p in prompts]

    def _check_room(self, ids: list, params: SamplingParams, aliases: dict[str, str]) -> None:
        """vLLM's 400 for a ``max_tokens`` that the context cannot hold after the prompt (rather
        than generating until the context is full)."""
        limit = self.engine.engine.info.max_model_len
        if params.max_tokens is None:
            return
        for p in ids:
            if isinstance(p, list) and len(p) < limit and len(p) + params.max_tokens > limit:
                name = aliases.get("max_tokens", "max_tokens")
                raise ApiError(400, f"{name}: {params.max_tokens} is too large: this model's maximum context length "
                                    f"is {limit} tokens and the request has {len(p)} input tokens "
                                    f"({params.max_tokens} > {limit} - {len(p)})", param=name)

    @staticmethod
    def _structured_outputs(req: Any, aliases: dict[str, str]) -> dict | None:
        """``response_format`` (OpenAI) or ``structured_outputs`` (vLLM) as StructuredOutputsParams'
        dict form; errors about it will name the field the client sent (``aliases``)."""
        rf, so = req.response_format, req.structured_outputs
        if rf is not None and rf.type != "text":
            if so is not None:
                raise ApiError(400, "structured_outputs: set either structured_outputs or response_format, not both",
                               param="structured_outputs")
            if rf.type == "json_object":
                aliases["structured_outputs.json_object"] = "response_format"
                return {"json_object": True}
            if rf.type == "json_schema":
                if rf.json_schema is None or not isinstance(rf.json_schema.schema, dict):
                    raise ApiError(400, "response_format.json_schema.schema: a JSON schema object is required "
                                        "for type 'json_schema'", param="response_format.json_schema.schema")
                aliases["structured_outputs.json"] = "response_format.json_schema.schema"
                return {"json": rf.json_schema.schema}
            raise ApiError(400, f"response_format.type: must be 'text', 'json_object' or 'json_schema', got "
                                f"{rf.type!r}", param="response_format.type")
        return so

    async def _generate(self, request: web.Request, t0: float, fmt_type: type[_Format],
                        req: ChatCompletionRequest | CompletionRequest, prompts: list, params: SamplingParams,
                        aliases: dict[str, str], tools: ToolPlan | None = None) -> web.StreamResponse:
        fmt = fmt_type(f"{fmt_type.id_prefix}-{uuid.uuid4().hex}", int(time.time()), self.config.model_name,
                       params.logprobs or 0, self.token_text)
        if tools is not None and tools.mode != "none":
            fmt.tools = tools
        deadline = t0 + self.config.request_timeout
        streams: list[RequestStream] = []
        try:
            try:
                async with _timeout_at(deadline):
                    ids = await self._off_loop(lambda: self._prepare_prompts(prompts, params))
                    self._check_room(ids, params, aliases)
                    rids = [fmt.id if len(prompts) == 1 else f"{fmt.id}-{i}" for i in range(len(prompts))]
                    streams.extend(await self.engine.add_requests(list(zip(rids, ids)), params))
            except OverflowError as e:
                raise ApiError(503, f"the server is overloaded: {e}; retry later", type="server_error",
                               code="overloaded", headers={"Retry-After": "1"}) from None
            except ValueError as e:
                raise bad_request(e, aliases) from None
            except (TimeoutError, EngineDeadError) as e:
                raise _engine_error(e) from None
            if req.stream:
                return await self._stream(request, t0, deadline, fmt, streams, params, req.include_usage)
            return await self._complete(t0, deadline, fmt, streams, params)
        finally:
            for s in streams:
                s.abort()

    async def _complete(self, t0: float, deadline: float, fmt: _Format, streams: list[RequestStream],
                        params: SamplingParams) -> web.Response:
        loop = asyncio.get_running_loop()
        finals: list[RequestOutput | None] = [None] * len(streams)
        ttft = None
        try:
            async with _timeout_at(deadline), contextlib.aclosing(_merge(streams)) as merged:
                async for i, out in merged:
                    if ttft is None:
                        ttft = loop.time() - t0
                    if out.finished:
                        finals[i] = out
        except Exception as e:
            raise _engine_error(e) from None
        done = [f for f in finals if f is not None]
        assert len(done) == len(finals), "a stream ended without a finished output"
        choices = [(i * params.n + co.index, co) for i, out in enumerate(done) for co in out.outputs]
        resp = fmt.response(choices, self._observe(t0, ttft, done))
        if params.prompt_logprobs is not None:  # vLLM's places: per choice (completions), per response (chat)
            if isinstance(resp, ChatCompletionResponse):
                resp.prompt_logprobs = prompt_logprobs_wire(done[0].prompt_logprobs)
            else:
                for c in resp.choices:
                    c.prompt_logprobs = prompt_logprobs_wire(done[c.index // params.n].prompt_logprobs)
        return _json(resp)

    async def _stream(self, request: web.Request, t0: float, deadline: float, fmt: _Format,
                      streams: list[RequestStream], params: SamplingParams, include_usage: bool) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        num_choices = len(streams) * params.n
        finals: list[RequestOutput | None] = [None] * len(streams)
        states = [_ChoiceState() for _ in range(num_choices)]
        ttft = None
        try:
            await resp.prepare(request)
            try:
                async with _timeout_at(deadline), contextlib.aclosing(_merge(streams)) as merged:
                    start = fmt.start_chunks(num_choices)
                    if start:
                        await resp.write(b"".join(map(_sse, start)))
                    async for i, out in merged:
                        if ttft is None:
                            ttft = loop.time() - t0
                        if out.finished:
                            finals[i] = out
                        chunks = _delta_chunks(fmt, i * params.n, out, states)
                        if chunks:
                            await resp.write(b"".join(map(_sse, chunks)))
            except ConnectionResetError:
                raise
            except Exception as e:  # the engine failed or the deadline passed: the stream ends with the error
                await resp.write(_sse(_engine_error(e).body()))
            else:
                usage = self._observe(t0, ttft, [f for f in finals if f is not None])
                if include_usage:
                    await resp.write(_sse(fmt.usage_chunk(usage)))
            await resp.write(_SSE_DONE)
            await resp.write_eof()
        except ConnectionResetError:  # the client went away; the caller aborts the streams
            request[_STATUS_KEY] = _CLIENT_CLOSED
        return resp

    def _observe(self, t0: float, ttft: float | None, finals: list[RequestOutput]) -> Usage:
        """Record a finished request in the metrics; returns its usage."""
        usage = _usage(finals)
        e2e = asyncio.get_running_loop().time() - t0
        steps = max((len(co.token_ids) for f in finals for co in f.outputs), default=0)
        self.metrics.observe_request(ttft, e2e, usage.prompt_tokens, usage.completion_tokens, steps,
                                     [co.finish_reason for f in finals for co in f.outputs if co.finish_reason])
        return usage


def _check_tool_messages(messages: list) -> None:
    """As OpenAI: a "tool" message answers a call of an earlier assistant turn, by its id."""
    call_ids: set[str] = set()
    for i, m in enumerate(messages):
        if m.role == "assistant" and m.tool_calls:
            call_ids.update(c.id for c in m.tool_calls)
        elif m.role == "tool":
            if m.tool_call_id is None:
                raise ApiError(400, f"messages[{i}].tool_call_id: a 'tool' message needs the id of the call it answers",
                               param=f"messages[{i}].tool_call_id")
            if m.tool_call_id not in call_ids:
                raise ApiError(400, f"messages[{i}].tool_call_id: {m.tool_call_id!r} is not the id of a tool call "
                                    "of an earlier assistant message", param=f"messages[{i}].tool_call_id")


def _delta_chunks(fmt: _Format, base: int, out: RequestOutput, states: list[_ChoiceState]) -> list[msgspec.Struct]:
    """The stream chunks for one engine output (of kind "delta"): new text, new logprobs (when they
    were asked for), and each choice's finish reason once."""
    chunks = []
    for co in out.outputs:
        index = base + co.index
        st = states[index]
        lps = co.delta_token_logprobs
        finish = co.finish_reason if co.finish_reason and not st.finished else None
        if not co.delta_text and not lps and finish is None:
            continue
        st.finished = st.finished or finish is not None
        chunks.append(fmt.delta_chunk(index, co.delta_text, lps, st.num_sent_chars, finish,
                                      co.stop_reason if finish is not None else None))
        st.num_sent_chars += len(co.delta_text)
    return chunks


def _json(obj: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=encode(obj), content_type="application/json")


SERVER_KEY = web.AppKey("prefixkv_server", _Server)


def create_app(engine: AsyncEngine, config: ServerConfig) -> web.Application:
    """The aiohttp app. It owns ``engine``: the app's shutdown shuts the engine down (in-flight
    requests are aborted and end with an error)."""
    server = _Server(engine, config)
    app = web.Application(client_max_size=config.max_body_bytes,
                          middlewares=[server.errors_middleware, server.auth_middleware])
    app[SERVER_KEY] = server
    app.router.add_post("/v1/chat/completions", server.chat_completions)
    app.router.add_post("/v1/completions", server.completions)
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
        server._tokenize_pool.shutdown(wait=False, cancel_futures=True)

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


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(model_name=args.served_model_name or default_model_name(args.model),
                        api_key=args.api_key or os.environ.get("PREFIXKV_API_KEY") or None,
                        max_body_bytes=args.max_body_bytes, request_timeout=args.request_timeout,
                        tool_call_parser=getattr(args, "tool_call_parser", None),
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
