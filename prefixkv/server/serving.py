"""The OpenAI-compatible API, transport-independent: request bodies in, ``Reply`` objects out.

``OpenAIServing`` parses and validates requests (msgspec), renders chat templates and tokenizes off
the event loop, builds ``SamplingParams``, adds requests to the engine (an ``EngineClient``) and turns its outputs
into OpenAI's wire objects: a JSON body, or an SSE byte stream (``data: {json}\n\n`` ...
``data: [DONE]\n\n``). It knows no HTTP library: ``server/app.py`` (aiohttp) adapts it, and any
other front end (a Ray Serve ingress) can, with the same routes, errors and streams.

One request, start to end::

    body (the adapter enforces max_body_bytes: 413) -> msgspec decode (400 + field path) -> model
    check (404) -> SamplingParams (400, param = the field) -> [chat template off the loop]
    -> EngineClient.add_requests (400 prompt too long, 503 queue full)    <- nothing sent yet
    -> Reply(body) | Reply(stream)                                         <- 200 from here on
    closing the stream early (client disconnect, timeout, shutdown) aborts the request in the
    engine, which frees its KV blocks.

Errors are OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}`` (``ApiError``); bad
input never yields a 500.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import dataclasses
import hashlib
import hmac
import logging
import re
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import msgspec

from prefixkv.engine_client import CacheControl, EngineClient, OutputStream
from prefixkv.errors import EngineDeadError, EngineFatalError, ReplicaDiedError, RequestAbortedError
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
    ApiRequest,
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
    echo_logprobs,
    encode,
    make_usage,
    prompt_list,
    prompt_logprobs_wire,
)
from prefixkv.server.reasoning import REASONING_PARSERS, ReplyParser, thinking_enabled
from prefixkv.server.tools import AUTO, PARSERS, ToolPlan, detect_tool_parser, plan_tools
from prefixkv.streams import RequestStream

logger = logging.getLogger(__name__)

_PARAM = re.compile(r"[A-Za-z_][\w.\[\]]*")
_SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

if sys.version_info >= (3, 11):
    timeout_at = asyncio.timeout_at
else:  # Python 3.10: the same contract, without Task.uncancel
    @contextlib.asynccontextmanager
    async def timeout_at(when: float):
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


class StreamDeadline:
    """A streamed request's timeout: one timer for the whole stream (``asyncio.wait_for`` on each
    output would cost a task and a timer per token). ``wait(aw)`` awaits ``aw`` and raises
    ``TimeoutError`` if the deadline passes during the wait or passed before it; the consumer's
    work between two waits (the transport's writes) is never cancelled. Built, waited on and
    closed in one task."""

    __slots__ = ("_task", "_handle", "_waiting", "_fired")

    def __init__(self, when: float) -> None:
        self._task = asyncio.current_task()
        self._waiting = False
        self._fired = False
        self._handle = asyncio.get_running_loop().call_at(when, self._fire)

    def _fire(self) -> None:
        self._fired = True
        if self._waiting:
            self._task.cancel()

    async def wait(self, aw: Any) -> Any:
        if self._fired:
            raise TimeoutError
        self._waiting = True
        try:
            return await aw
        except asyncio.CancelledError:
            # ours if the deadline fired and nothing else cancelled the task meanwhile
            if self._fired and (sys.version_info < (3, 11) or self._task.uncancel() == 0):
                raise TimeoutError from None
            raise
        finally:
            self._waiting = False

    def close(self) -> None:
        self._handle.cancel()


CACHE_ISOLATIONS = ("none", "api-key")


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    api_key: str | None = field(default=None, repr=False)  # (no key in a log line or a traceback)
    # more keys (``--api-key`` given again, ``--api-keys-file``): any one is accepted
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    # "api-key": each key's requests share prefix-cache blocks only with that key's (``Tenant``)
    cache_isolation: str = "none"
    max_body_bytes: int = 4 << 20
    request_timeout: float = 600.0  # seconds from arrival until the request is aborted
    # "hermes" | "llama3_json" | "auto" (the chat template's format, if recognised): tool_choice "auto"
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None  # "qwen3" | "deepseek_r1": <think> ... </think> (server/reasoning.py)
    cache_view_text: bool = False  # /v1/cache/summary (the /cache page) may show the cached runs' text
    # POST /v1/responses with store (the default): responses kept for previous_response_id and GET,
    # least recently used dropped first beyond either bound (server/responses.py)
    max_stored_responses: int = 1000
    max_stored_response_bytes: int = 64 << 20
    # POST /reset_prefix_cache (vLLM's, a development route there) drops every tenant's cached
    # blocks: refused (403) unless the operator turns it on
    enable_reset_prefix_cache: bool = False

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in (*PARSERS, AUTO):
            raise ValueError(f"tool_call_parser: must be one of {', '.join((*PARSERS, AUTO))}, got "
                             f"{self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser: must be one of {', '.join(REASONING_PARSERS)}, got "
                             f"{self.reasoning_parser!r}")
        if self.max_stored_responses < 0 or self.max_stored_response_bytes < 0:
            raise ValueError("max_stored_responses: the store's bounds must be non-negative")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes: must be positive, got {self.max_body_bytes}")
        if not self.request_timeout > 0:
            raise ValueError(f"request_timeout: must be positive, got {self.request_timeout}")
        if self.cache_isolation not in CACHE_ISOLATIONS:
            raise ValueError(f"cache_isolation: must be one of {', '.join(CACHE_ISOLATIONS)}, got "
                             f"{self.cache_isolation!r}")
        if any(not isinstance(k, str) or not k or k != k.strip() for k in self.keys):
            raise ValueError("api_key: a key must be a non-empty string without surrounding whitespace")
        if self.cache_isolation == "api-key" and not self.keys:
            raise ValueError("cache_isolation: 'api-key' partitions the cache by API key, but no key is set "
                             "(--api-key, --api-keys-file)")

    @property
    def keys(self) -> tuple[str, ...]:
        """Every accepted API key, each once, in the order given."""
        return tuple(dict.fromkeys(([self.api_key] if self.api_key else []) + list(self.api_keys)))


@dataclass(frozen=True)
class Tenant:
    """Who a request authenticated as: its API key's ``index`` in ``ServerConfig.keys`` (a label
    for metrics: never the key) and its cache ``partition``, a SHA-256 of the key (the same after
    a restart, so the disk tier's files stay with their tenant; the key itself is nowhere in the
    cache, the metrics or the logs)."""

    index: int
    partition: str

    @classmethod
    def of(cls, index: int, key: str) -> Tenant:
        return cls(index, hashlib.sha256(b"prefixkv cache partition\0" + key.encode()).hexdigest())

    @property
    def label(self) -> str:
        return f"key{self.index}"


# the tenant of the request being handled: set by ``OpenAIServing.authenticate`` (the transports
# call it first, in the task that then runs the route), read by ``add_requests`` and ``observe``
_TENANT: contextvars.ContextVar[Tenant | None] = contextvars.ContextVar("prefixkv_tenant", default=None)


async def read_body(chunks: AsyncIterator[bytes], content_length: int | None, limit: int, deadline: float) -> bytes:
    """A request body from the transport's ``chunks``, for every front end: 413 when the declared
    ``content_length`` or the bytes received pass ``limit``, 408 when the body has not arrived by
    ``deadline`` (``loop.time()``; the request timeout counts from arrival, so a body that trickles
    in is cut off too)."""
    if content_length is not None and content_length > limit:
        raise ApiError(413, f"the request body ({content_length} bytes) is larger than the server's limit of "
                            f"{limit} bytes", code="request_too_large")
    parts, size = [], 0
    try:
        async with timeout_at(deadline):
            async for chunk in chunks:
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"the request body is larger than the server's limit of {limit} bytes",
                                   code="request_too_large")
                parts.append(chunk)
    except TimeoutError:
        raise ApiError(408, "the request body did not arrive within the request timeout",
                       code="request_timeout") from None
    return b"".join(parts)


# ---------------------------------------------------------------------- what a route answers
@dataclass
class Reply:
    """A route's answer, for the transport to send: a body, or (``stream``) an SSE byte stream."""

    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] | None = None
    stream: EventStream | None = None


class ChunkWriter(Protocol):
    """A transport's write that does not await, for an ``EventStream`` to write the deltas of a
    step from the engine client's callback (``RequestStream.on_output``) instead of waking its
    task. ``writable()`` is False while it cannot take more now (the client has its limit of unread
    bytes, or is gone): the stream then leaves the outputs to its task, which writes them through
    the transport's own path (where a slow client is waited for, and the steps behind merge).
    ``write`` is called only right after ``writable()`` said True, with a whole number of events."""

    def writable(self) -> bool: ...

    def write(self, data: bytes) -> None: ...


class EventStream:
    """The SSE bytes of a streamed completion. The transport iterates it and must ``aclose()`` it
    however it ends (finished, client gone, cancelled): that aborts the engine requests behind it
    (a no-op for those already finished), started or not. A transport that can write without
    awaiting sets ``writer`` before iterating; the stream may then write some of its bytes there,
    always after the ones the iterator gave before and before the ones it gives after."""

    def __init__(self, chunks: AsyncIterator[bytes] | None, streams: list[OutputStream]) -> None:
        self.chunks = chunks  # (None: set right after, by a producer that needs the stream itself)
        self.writer: ChunkWriter | None = None
        self._streams = streams

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self.chunks

    async def aclose(self) -> None:
        try:
            await self.chunks.aclose()
        finally:
            for s in self._streams:
                s.abort()


def json_reply(obj: object, status: int = 200) -> Reply:
    return Reply(status, encode(obj))


# ---------------------------------------------------------------------- errors
class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> ErrorResponse:
        return ErrorResponse(ErrorBody(self.message, self.type, self.param, self.code))

    def reply(self) -> Reply:
        return Reply(self.status, encode(self.body()), headers=self.headers)


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
    if isinstance(e, ReplicaDiedError):
        return ApiError(503, str(e), type="server_error", code="replica_died")
    if isinstance(e, RequestAbortedError):
        return ApiError(503, str(e), type="server_error", code="aborted")
    logger.error("request failed in the engine", exc_info=e)
    return ApiError(500, f"internal error in the engine: {type(e).__name__}: {e}", type="server_error",
                    code="internal_error")


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
    started: bool = False  # its first chunk was sent


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
    show_prompt_logprobs: bool = False  # the request asked for vLLM's ``prompt_logprobs`` field
    _text_events: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)  # delta_event's, per choice

    def start_chunks(self, num_choices: int) -> list[msgspec.Struct]:
        return []

    def delta_chunk(self, index: int, text: str, lps: list[TokenLogprob] | None, text_offset: int,
                    finish_reason: str | None, stop_reason: int | str | None = None) -> msgspec.Struct:
        choice = self._delta_choice(index, text, self._logprobs_or_none(lps, text_offset), finish_reason, stop_reason)
        return self.chunk_type(self.id, self.created, self.model, [choice])

    @property
    def plain_deltas(self) -> bool:
        """A delta chunk of text alone is ``delta_chunk``'s bytes with only the text changing."""
        return True

    def delta_event(self, index: int, text: str, lps: list[TokenLogprob] | None, text_offset: int,
                    finish_reason: str | None, stop_reason: int | str | None = None) -> bytes:
        """``_sse(delta_chunk(...))``. A chunk of new text alone (most of a stream) is built from
        bytes made once per choice -- the encoded chunk around its text -- and the text's own JSON,
        byte for byte what encoding the whole chunk gives."""
        if lps is not None or finish_reason is not None or not self.plain_deltas:
            return _sse(self.delta_chunk(index, text, lps, text_offset, finish_reason, stop_reason))
        around = self._text_events.get(index)
        if around is None:
            raw = _sse(self.delta_chunk(index, _TEXT_MARK, None, 0, None, None))
            head, _, tail = raw.partition(_TEXT_MARK_JSON)
            around = self._text_events[index] = (head, tail)
        return around[0] + msgspec.json.encode(text) + around[1]

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
    reasoning: bool = False  # the reply's reasoning is split out (server/reasoning.py)
    _parsers: dict[int, ReplyParser] = field(default_factory=dict)  # choice index -> its stream's parser

    def response(self, choices: list[tuple[int, CompletionOutput]], usage: Usage) -> msgspec.Struct:
        if self.tools is None and not self.reasoning:
            return super().response(choices, usage)
        out = []
        for index, co in choices:
            parser = ReplyParser(self.tools, self.reasoning)
            parser.feed(co.text)
            parser.close()
            calls = [ToolCallOut(c.id, FunctionCall(c.name, c.arguments)) for c in parser.calls] or None
            finish = self.tools.calls_finish_reason if calls and co.finish_reason == "stop" else co.finish_reason
            out.append(ChatChoice(index, ChatMessageOut("assistant", parser.content, calls, parser.reasoning),
                                  self._logprobs_or_none(co.token_logprobs, 0), finish, co.stop_reason))
        return self.response_type(self.id, self.created, self.model, out, usage)

    def delta_chunk(self, index: int, text: str, lps: list[TokenLogprob] | None, text_offset: int,
                    finish_reason: str | None, stop_reason: int | str | None = None) -> msgspec.Struct:
        if self.tools is None and not self.reasoning:
            return super().delta_chunk(index, text, lps, text_offset, finish_reason, stop_reason)
        parser = self._parsers.setdefault(index, ReplyParser(self.tools, self.reasoning))
        reasoning, content, calls = parser.feed(text)
        if finish_reason is not None:
            more_reasoning, more, more_calls = parser.close()
            reasoning, content, calls = reasoning + more_reasoning, content + more, calls + more_calls
            if parser.calls and finish_reason == "stop":
                finish_reason = self.tools.calls_finish_reason
        delta = DeltaMessage(content=content or None, tool_calls=calls or None, reasoning_content=reasoning or None)
        choice = ChatChunkChoice(index, delta, self._logprobs_or_none(lps, text_offset), finish_reason, stop_reason)
        return self.chunk_type(self.id, self.created, self.model, [choice])

    @property
    def plain_deltas(self) -> bool:
        return self.tools is None and not self.reasoning

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


@dataclass
class _CompletionFormat(_Format):
    id_prefix = "cmpl"
    chunk_type = response_type = CompletionResponse  # OpenAI streams the response object itself
    _choice = _delta_choice = staticmethod(CompletionChoice)
    echo_texts: list[str] | None = None  # echo: each prompt's text, which its choices' texts begin with

    def _logprobs(self, lps: list[TokenLogprob], text_offset: int) -> CompletionLogprobs:
        return completion_logprobs(lps, self.token_text, self.num_top_logprobs, text_offset)

    def prepend_echo(self, choice: CompletionChoice, prompt_index: int, out: RequestOutput) -> int:
        """echo: the prompt's text (and, with logprobs, its tokens' logprobs: the engine computed
        them as ``prompt_logprobs``) before what ``choice`` holds. Returns the characters added."""
        text = self.echo_texts[prompt_index]
        if choice.logprobs is not None:
            head = echo_logprobs(out.prompt_token_ids, out.prompt_token_logprobs, self.token_text,
                                 self.num_top_logprobs)
            tail = choice.logprobs
            choice.logprobs = CompletionLogprobs(head.tokens + tail.tokens, head.token_logprobs + tail.token_logprobs,
                                                 head.top_logprobs + tail.top_logprobs,
                                                 head.text_offset + [o + len(text) for o in tail.text_offset])
        choice.text = text + choice.text
        return len(text)


def _sse(obj: object) -> bytes:
    return b"data: " + encode(obj) + b"\n\n"


_TEXT_MARK = "\x00prefixkv-text\x00"  # no model text is this: control characters around a name
_TEXT_MARK_JSON = msgspec.json.encode(_TEXT_MARK)


async def _merge(streams: list[OutputStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: OutputStream) -> None:
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


class PromptOnlyStream:
    """A request run for its prompt alone (``max_tokens: 0`` with echo): the engine samples one
    token (its logits are computed for the last prompt position anyway), which this stream drops,
    so the outputs hold no tokens and finish with "length"."""

    def __init__(self, stream: OutputStream) -> None:
        self._stream = stream

    @property
    def done(self) -> bool:
        return self._stream.done

    def __aiter__(self) -> PromptOnlyStream:
        return self

    async def __anext__(self) -> RequestOutput:
        out = await self._stream.__anext__()
        empty = lambda lps: None if lps is None else []  # noqa: E731
        outputs = [dataclasses.replace(co, token_ids=[], text="", delta_text="", delta_token_ids=[],
                                       token_logprobs=empty(co.token_logprobs),
                                       delta_token_logprobs=empty(co.delta_token_logprobs),
                                       finish_reason="length" if co.finish_reason else None, stop_reason=None)
                   for co in out.outputs]
        return dataclasses.replace(out, outputs=outputs)

    def abort(self) -> None:
        self._stream.abort()


@contextlib.contextmanager
def _admission_errors(aliases: dict[str, str]):
    """What adding requests to the engine can raise, as the API's errors (nothing was started)."""
    try:
        yield
    except OverflowError as e:
        raise ApiError(503, f"the server is overloaded: {e}; retry later", type="server_error",
                       code="overloaded", headers={"Retry-After": "1"}) from None
    except ValueError as e:
        raise bad_request(e, aliases) from None
    except (TimeoutError, EngineDeadError) as e:
        raise _engine_error(e) from None


@dataclass(frozen=True)
class Retention:
    """A request that a prompt's prefix stay in the prefix cache (see ``OpenAIServing.add_requests``)."""

    num_tokens: int | None  # the prefix's length in tokens; None: the whole conversation
    ttl_s: float | None  # None: STORED_RETENTION_TTL_S (a stored Responses conversation)
    handle: str | None = None  # held under this name until released (a stored response's id)


# vLLM's query parameters of POST /reset_prefix_cache -> the values we accept
_RESET_PARAMS = {"reset_running_requests": ("false", "0"), "reset_external": ("true", "false", "1", "0")}
# A stored Responses conversation is retained this long since its last use (a continuation refreshes it).
STORED_RETENTION_TTL_S = 3600.0
# SamplingParams' retention fields -> the chat / completions field the client sent
_RETENTION_ALIASES = {"kv_retention_ttl_s": "kv_retention.ttl_s", "kv_retention_tokens": "kv_retention.num_tokens"}


def _usage(finals: list[RequestOutput]) -> Usage:
    return make_usage(sum(o.num_prompt_tokens for o in finals), sum(o.num_output_tokens for o in finals),
                      sum(o.num_cached_tokens for o in finals))


def constrain_to_tools(so: dict | None, tools: ToolPlan | None, aliases: dict[str, str], field: str, choices: str,
                       rename: Callable[[str], str] = lambda name: name) -> dict | None:
    """The structured outputs of a reply: the format's (``so``, from ``field``), or, when the reply
    must be tool calls (``choices``), the tools' grammar, its field names ``rename``d into the API's
    for the errors it may raise; both at once is a 400 naming ``field``. Every API's one rule."""
    if tools is None or tools.structured_outputs is None:
        return so
    if so is not None:
        raise ApiError(400, f"{field}: cannot be combined with {choices}", param=field)
    aliases.update({k: rename(v) for k, v in tools.aliases.items()})
    return tools.structured_outputs


# ---------------------------------------------------------------------- the API
class OpenAIServing:
    """The routes' logic. ``t0`` (the request's arrival, ``loop.time()``) starts its timeout and its
    latency metrics; bodies are the raw request bytes.

    ``engine`` is any ``EngineClient`` (prefixkv/engine_client.py): the in-process ``AsyncEngine``,
    the engine-core process's client, or the Ray Serve ingress's ``RemoteEngine``. ``close()``
    releases what the layer itself holds (not the engine)."""

    def __init__(self, engine: EngineClient, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.metrics = ServerMetrics(engine.stats, config.model_name)
        self.token_text = TokenTexts(engine.tokenizer)
        self.max_model_len = engine.info.max_model_len
        self.created = int(time.time())
        self._tenants = [(f"Bearer {key}".encode(), Tenant.of(i, key)) for i, key in enumerate(config.keys)]
        self.isolate = config.cache_isolation == "api-key"
        # chat templates and tokenization of (possibly huge) prompts: off the engine thread and off
        # the event loop
        self.tokenizer = engine.tokenizer
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefixkv-tokenize")
        self.tool_call_parser = config.tool_call_parser
        if self.tool_call_parser == AUTO:
            self.tool_call_parser, why = detect_tool_parser(getattr(engine.tokenizer, "chat_template", "") or "")
            logger.info("tool-call parser: %s (%s)", self.tool_call_parser or "none, tool_choice 'auto' is refused", why)
        from prefixkv.server.messages import MessagesServing
        from prefixkv.server.responses import ResponsesServing

        self.responses = ResponsesServing(self)
        self.messages = MessagesServing(self)

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    def close(self) -> None:
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ access
    def needs_key(self, path: str) -> bool:
        return bool(self._tenants) and (path == "/v1" or path.startswith("/v1/")
                                        or path in ("/tokenize", "/detokenize", "/reset_prefix_cache"))

    def authenticate(self, path: str, authorization: str | None, x_api_key: str | None = None) -> None:
        """A request's credentials, before its route runs (in the same task): 401 where ``path``
        needs a key and none of the server's is given; sets the request's tenant (None without keys
        or on open paths), which ``add_requests`` partitions the prefix cache by."""
        _TENANT.set(self.check_key(authorization, x_api_key) if self.needs_key(path) else None)

    def check_key(self, authorization: str | None, x_api_key: str | None = None) -> Tenant:
        """The tenant whose key ``authorization`` (``Bearer <key>``) or ``x_api_key`` (the
        ``x-api-key`` header, Anthropic's) is, else 401. Every key is compared, in constant time,
        so the time taken tells nothing of which key matched or how much of one did."""
        given = [(authorization or "").encode()]
        if x_api_key is not None:
            given.append(f"Bearer {x_api_key}".encode())
        found = None
        for expected, tenant in self._tenants:
            for g in given:
                if hmac.compare_digest(g, expected) and found is None:
                    found = tenant
        if found is not None:
            return found
        raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def error_reply(self, e: ApiError, path: str) -> Reply:
        """An error in the shape of the API ``path`` belongs to: Anthropic's for /v1/messages,
        OpenAI's for the rest."""
        from prefixkv.server.messages import is_messages_path, messages_error_reply

        return messages_error_reply(e) if is_messages_path(path) else e.reply()

    # ------------------------------------------------------------------ simple routes
    def health(self) -> Reply:
        if not self.engine.is_running:
            return Reply(503, b'{"status": "unavailable"}')
        return Reply(200, b'{"status": "ok"}')

    def metrics_reply(self) -> Reply:
        body, content_type = self.metrics.render()
        return Reply(200, body, content_type)

    async def reset_prefix_cache(self, query: Mapping[str, str]) -> Reply:
        """``POST /reset_prefix_cache`` (vLLM's): every cached block dropped, in every tier
        (``LLMEngine.reset_prefix_cache``; KV events tell ``AllBlocksCleared``). Behind the API key
        where keys are set, and refused (403) unless ``enable_reset_prefix_cache``: the cache is
        every tenant's, so with ``--cache-isolation api-key`` any key could otherwise empty the
        others'. Refused (409) while a request runs or waits, as the engine does. ``query``:
        vLLM's ``reset_running_requests`` (only false) and ``reset_external`` (either: every
        tier is reset); any other parameter is a 400 naming it. With Ray replicas every replica
        resets (serve/ingress.py: a 409 if one refused) and a replica that does not confirm it is
        a 503 (``reset_not_confirmed``); 501 where the engine has no way to reset."""
        if not self.config.enable_reset_prefix_cache:
            raise ApiError(403, "POST /reset_prefix_cache is off: the server must be started with "
                                "--enable-reset-prefix-cache (it empties every tenant's prefix cache)",
                           type="permission_error", code="reset_prefix_cache_disabled")
        for name, value in query.items():
            allowed = _RESET_PARAMS.get(name)
            if allowed is None:
                raise ApiError(400, f"{name[:40]}: not a parameter of /reset_prefix_cache (known: "
                                    f"{', '.join(_RESET_PARAMS)})", param=name[:40])
            if value.lower() not in allowed:
                raise ApiError(400, f"{name}: must be {' or '.join(allowed)} (the cache is reset while no request "
                                    f"runs, in every tier), got {value!r:.40}", param=name)
        if not isinstance(self.engine, CacheControl):
            raise ApiError(501, "POST /reset_prefix_cache: this engine cannot reset its caches from here",
                           type="server_error", code="not_implemented")
        try:
            done = await self.engine.reset_prefix_cache()
        except EngineDeadError as e:
            raise _engine_error(e) from None
        except NotImplementedError as e:
            raise ApiError(501, str(e), type="server_error", code="not_implemented") from None
        except TimeoutError as e:  # (several replicas: one did not answer)
            raise ApiError(503, f"the prefix cache's reset is not confirmed: {e}", type="server_error",
                           code="reset_not_confirmed", headers={"Retry-After": "1"}) from None
        if not done:
            raise ApiError(409, "the prefix cache can be reset only while no request runs or waits: retry when "
                                "the server is idle", code="requests_running")
        logger.info("the prefix cache was reset (POST /reset_prefix_cache)")
        return json_reply({"success": True})

    def _card(self) -> ModelCard:
        return ModelCard(self.config.model_name, self.created, max_model_len=self.max_model_len)

    def version(self) -> Reply:
        from prefixkv import __version__

        return json_reply(VersionResponse(__version__))

    async def tokenize(self, body: bytes) -> Reply:
        """vLLM's /tokenize (a prompt, or chat messages through the template)."""
        req = decode_request(body, TokenizeRequest)
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
        return json_reply(TokenizeResponse(len(ids), self.max_model_len, ids, strs))

    async def detokenize(self, body: bytes) -> Reply:
        req = decode_request(body, DetokenizeRequest)
        self._check_model(req.model)
        v = self.engine.info.vocab_size
        bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < v), None)
        if bad is not None:
            raise ApiError(400, f"tokens[{bad}]: {req.tokens[bad]} is not a token id of this model (vocabulary "
                                f"size {v})", param=f"tokens[{bad}]")
        return json_reply(DetokenizeResponse(await self._off_loop(lambda: self.tokenizer.decode(req.tokens))))

    def models(self) -> Reply:
        return json_reply(ModelList([self._card()]))

    def model(self, name: str) -> Reply:
        self._check_model(name)
        return json_reply(self._card())

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.model_name:
            raise ApiError(404, f"model: {name!r} does not exist; this server serves {self.config.model_name!r}",
                           param="model", code="model_not_found")

    # ------------------------------------------------------------------ generation routes
    async def chat_completions(self, body: bytes, t0: float) -> Reply:
        req = decode_request(body, ChatCompletionRequest)
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
                           self.tool_call_parser)
        params = self._params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None, aliases, tools)
        _check_tool_messages(req.messages)
        messages = [msgspec.to_builtins(m) for m in req.messages]
        try:
            prompt = await self._off_loop(lambda: self.tokenizer.apply_chat_template(
                messages, tools=tools.tools if tools else None, template_kwargs=req.chat_template_kwargs))
        except ValueError as e:
            raise bad_request(e) from None
        reasoning = thinking_enabled(self.config.reasoning_parser, req.chat_template_kwargs, params.structured_outputs)
        return await self._generate(t0, _ChatFormat, req, [prompt], params, aliases, tools, reasoning=reasoning)

    async def completions(self, body: bytes, t0: float) -> Reply:
        req = decode_request(body, CompletionRequest)
        self._check_model(req.model)
        if req.suffix:
            raise ApiError(400, "suffix: is not supported", param="suffix")
        prompts = prompt_list(req.prompt)
        limit = self.engine.max_waiting_requests
        if len(prompts) > limit:
            raise ApiError(400, f"prompt: a batch of {len(prompts)} prompts is larger than the server's waiting "
                                f"queue ({limit})", param="prompt")
        prompt_only = req.max_tokens == 0  # vLLM's: with echo, the prompt (and its logprobs) alone
        if prompt_only and not req.echo:
            raise ApiError(400, "max_tokens: 0 is only allowed with echo (the reply is then the prompt alone)",
                           param="max_tokens")
        params = self._params(req, 1 if prompt_only else req.max_tokens, req.logprobs, {})
        if req.echo and req.logprobs is not None:  # the prompt's logprobs: it is computed whole (no cache hit)
            params = dataclasses.replace(params, prompt_logprobs=max(req.logprobs, params.prompt_logprobs or 0))
        return await self._generate(t0, _CompletionFormat, req, prompts, params, {}, prompt_only=prompt_only)

    def _params(self, req: Any, max_tokens: int | None, logprobs: int | None,
                aliases: dict[str, str], tools: ToolPlan | None = None) -> SamplingParams:
        bad = req.unsupported_field()
        if bad is not None:
            raise ApiError(400, f"{bad}: is not supported by this server", param=bad)
        if req.prompt_logprobs is not None and req.stream:
            raise ApiError(400, "prompt_logprobs: is not supported with stream (ask without streaming)",
                           param="prompt_logprobs")
        kw: dict[str, Any] = dict(max_tokens=max_tokens, stop=req.stop, logprobs=logprobs, output_kind="delta")
        so = constrain_to_tools(self._structured_outputs(req, aliases), tools, aliases,
                                "response_format" if req.response_format is not None else "structured_outputs",
                                "tool_choice 'required' or a named function")
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
                     "allowed_token_ids", "include_stop_str_in_output", "bad_words", "prompt_logprobs", "stream_interval"):
            value = getattr(req, name)
            if value is not None:
                kw[name] = value
        if req.kv_retention is not None:
            kw["kv_retention_ttl_s"], kw["kv_retention_tokens"] = req.kv_retention.ttl_s, req.kv_retention.num_tokens
            aliases = {**aliases, **_RETENTION_ALIASES}
        return self.sampling_params(kw, aliases)

    def sampling_params(self, kw: dict[str, Any], aliases: dict[str, str]) -> SamplingParams:
        """``SamplingParams(**kw)`` with the model's defaults (generation_config.json) where ``kw``
        has none (None: absent, except for ``max_tokens``: no limit but the context); a bad value is
        a 400 naming the field the client sent (``aliases``)."""
        kw = {k: v for k, v in kw.items() if v is not None or k == "max_tokens"}
        for name, value in self.engine.default_sampling.items():
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
            self.engine.compile_grammar(params.structured_outputs)
        return [self.tokenizer.encode(p) if isinstance(p, str) and p else p for p in prompts]

    def _check_room(self, ids: list, params: SamplingParams, aliases: dict[str, str]) -> None:
        """vLLM's 400 for a ``max_tokens`` that the context cannot hold after the prompt (rather
        than generating until the context is full)."""
        limit = self.engine.info.max_model_len
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

    async def _generate(self, t0: float, fmt_type: type[_Format], req: ChatCompletionRequest | CompletionRequest,
                        prompts: list, params: SamplingParams, aliases: dict[str, str],
                        tools: ToolPlan | None = None, prompt_only: bool = False, reasoning: bool = False) -> Reply:
        fmt = fmt_type(f"{fmt_type.id_prefix}-{uuid.uuid4().hex}", int(time.time()), self.config.model_name,
                       params.logprobs or 0, self.token_text)
        if tools is not None and tools.mode != "none":
            fmt.tools = tools
        if reasoning:
            fmt.reasoning = True
        fmt.show_prompt_logprobs = req.prompt_logprobs is not None
        deadline = t0 + self.config.request_timeout
        streams: list[OutputStream] = []
        handed_over = False  # a stream's EventStream aborts its requests when the transport closes it
        try:
            with _admission_errors(aliases):
                async with timeout_at(deadline):
                    ids = await self._off_loop(lambda: self._prepare_prompts(prompts, params))
                    self._check_room(ids, params, aliases)
                    if getattr(req, "echo", False):
                        fmt.echo_texts = await self._off_loop(
                            lambda: [p if isinstance(p, str) else self.tokenizer.decode(p) for p in prompts])
                    rids = [fmt.id if len(prompts) == 1 else f"{fmt.id}-{i}" for i in range(len(prompts))]
                    streams.extend(await self.add_requests(req, list(zip(rids, ids)), params))
                    if prompt_only:
                        streams[:] = [PromptOnlyStream(s) for s in streams]
            if req.stream:
                handed_over = True
                events = EventStream(None, streams)
                events.chunks = self._stream(t0, deadline, fmt, streams, params, req.include_usage, events)
                return Reply(200, content_type="text/event-stream", headers=dict(SSE_HEADERS), stream=events)
            return await self._complete(t0, deadline, fmt, streams, params)
        finally:
            if not handed_over:
                for s in streams:
                    s.abort()

    async def _complete(self, t0: float, deadline: float, fmt: _Format, streams: list[OutputStream],
                        params: SamplingParams) -> Reply:
        loop = asyncio.get_running_loop()
        finals: list[RequestOutput | None] = [None] * len(streams)
        ttft = None
        try:
            async with timeout_at(deadline), contextlib.aclosing(_merge(streams)) as merged:
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
        resp = fmt.response(choices, self.observe(t0, ttft, done))
        if isinstance(fmt, _CompletionFormat) and fmt.echo_texts is not None:
            for c in resp.choices:
                fmt.prepend_echo(c, c.index // params.n, done[c.index // params.n])
        if fmt.show_prompt_logprobs:  # vLLM's places: per choice (completions), per response (chat)
            if isinstance(resp, ChatCompletionResponse):
                resp.prompt_logprobs = prompt_logprobs_wire(done[0].prompt_logprobs)
            else:
                for c in resp.choices:
                    c.prompt_logprobs = prompt_logprobs_wire(done[c.index // params.n].prompt_logprobs)
        return json_reply(resp)

    async def _stream(self, t0: float, deadline: float, fmt: _Format, streams: list[OutputStream],
                      params: SamplingParams, include_usage: bool, events_out: EventStream) -> AsyncIterator[bytes]:
        """The SSE events of a streamed completion, as the engine's outputs arrive; a failure of the
        engine or the deadline ends it with an error event (then ``[DONE]``).

        One request (any ``n``) with a transport that writes without awaiting (``events_out.writer``):
        after the first output, the outputs that arrive while this waits are written from the
        engine client's callback, without waking this task (``_write_directly``)."""
        loop = asyncio.get_running_loop()
        num_choices = len(streams) * params.n
        finals: list[RequestOutput | None] = [None] * len(streams)
        states = [_ChoiceState() for _ in range(num_choices)]
        ttft = None
        merged = _merge(streams)
        timer = StreamDeadline(deadline)
        # one stream: _merge reads it in this task, so when its consumer waits, all it yielded is written
        direct = events_out.writer is not None and len(streams) == 1 and isinstance(streams[0], RequestStream)
        try:
            start = fmt.start_chunks(num_choices)
            if start:
                yield b"".join(map(_sse, start))
            while True:
                # the deadline bounds each wait here, not the transport's writes between them (a
                # timeout scope around a yield would cancel whatever the consumer awaits)
                try:
                    i, out = await timer.wait(merged.__anext__())
                except StopAsyncIteration:
                    break
                if ttft is None:
                    ttft = loop.time() - t0
                    if direct:
                        streams[0].on_output = _write_directly(fmt, params.n, states, events_out.writer)
                if out.finished:
                    finals[i] = out
                events = _delta_events(fmt, i, params.n, out, states)
                if events:  # one write per output: every choice's news of every step it stands for
                    yield b"".join(events)
        except Exception as e:  # the engine failed or the deadline passed: the stream ends with the error
            yield _sse(_engine_error(e).body())
        else:
            usage = self.observe(t0, ttft, [f for f in finals if f is not None])
            if include_usage:
                yield _sse(fmt.usage_chunk(usage))
        finally:
            if direct:
                streams[0].on_output = None
            timer.close()
            await merged.aclose()
        yield _SSE_DONE

    # ------------------------------------------------------------------ the engine, for every API
    async def add_requests(self, req: ApiRequest, requests: list[tuple[str, list[int]]], params: SamplingParams,
                           retention: Retention | None = None) -> list[OutputStream]:
        """The one place where a request of any API (chat, completions, responses, messages) reaches
        the engine. ``req`` is the decoded request: fields every API shares (``ApiRequest``) are read
        here: ``cache_salt``, and the partition of the API key the request authenticated with
        (``--cache-isolation api-key``; never anything the client names), which together choose the
        prefix cache the request shares (``SamplingParams.cache_salt`` / ``cache_partition``).
        ``retention`` asks that the prompt's prefix stay cached (Anthropic's ``cache_control``,
        a stored Responses conversation): it becomes the request's ``kv_retention_ttl_s`` /
        ``kv_retention_tokens`` / ``kv_retention_handle`` (chat and completions set the first two
        from their ``kv_retention``)."""
        tenant = _TENANT.get() if self.isolate else None
        if req.cache_salt is not None or tenant is not None:
            params = dataclasses.replace(params, cache_salt=req.cache_salt,
                                         cache_partition=None if tenant is None else tenant.partition)
        if retention is not None:
            params = dataclasses.replace(
                params, kv_retention_ttl_s=STORED_RETENTION_TTL_S if retention.ttl_s is None else retention.ttl_s,
                kv_retention_tokens=retention.num_tokens, kv_retention_handle=retention.handle)
        return await self.engine.add_requests(requests, params)

    async def render_chat(self, messages: list[dict], tools: list[dict] | None, template_kwargs: dict | None,
                          aliases: dict[str, str] | None = None) -> list[int]:
        """The chat template off the event loop; its ValueErrors are 400s naming the field the
        client sent (``aliases``: "messages" -> e.g. "input")."""
        try:
            return await self._off_loop(lambda: self.tokenizer.apply_chat_template(
                messages, tools=tools, template_kwargs=template_kwargs))
        except ValueError as e:
            raise bad_request(e, aliases) from None

    async def start(self, req: ApiRequest, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    aliases: dict[str, str], deadline: float, retention: Retention | None = None) -> OutputStream:
        """One prompt into the engine (its grammar compiled off the loop, its room checked): the
        stream of its outputs, or an ApiError (400, 503 overloaded, 504) with nothing started."""
        with _admission_errors(aliases):
            async with timeout_at(deadline):
                await self._off_loop(lambda: self._prepare_prompts([], params))
                self._check_room([prompt_ids], params, aliases)
                (stream,) = await self.add_requests(req, [(request_id, prompt_ids)], params, retention)
        return stream

    @staticmethod
    async def outputs(stream: OutputStream, deadline: float) -> AsyncIterator[RequestOutput]:
        """A started request's outputs until its last; the deadline bounds each wait (not the
        consumer's work between them). An engine failure or the deadline raises ApiError."""
        timer = StreamDeadline(deadline)
        try:
            while not stream.done:
                try:
                    out = await timer.wait(stream.__anext__())
                except StopAsyncIteration:
                    return
                except Exception as e:
                    raise _engine_error(e) from None
                yield out
        finally:
            timer.close()

    def observe(self, t0: float, ttft: float | None, finals: list[RequestOutput]) -> Usage:
        """Record a finished request in the metrics; returns its usage."""
        usage = _usage(finals)
        e2e = asyncio.get_running_loop().time() - t0
        steps = max((len(co.token_ids) for f in finals for co in f.outputs), default=0)
        self.metrics.observe_request(ttft, e2e, usage.prompt_tokens, usage.completion_tokens, steps,
                                     [co.finish_reason for f in finals for co in f.outputs if co.finish_reason])
        tenant = _TENANT.get() if self.isolate else None
        if tenant is not None:
            self.metrics.observe_partition(tenant.label, usage.prompt_tokens,
                                           sum(o.num_cached_tokens for o in finals))
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


def _write_directly(fmt: _Format, n: int, states: list[_ChoiceState],
                    writer: ChunkWriter) -> Callable[[RequestOutput], bool]:
    """``RequestStream.on_output`` for a one-request stream: an output's events, written at once
    while the writer takes them (the transport's buffer is below its limit)."""

    def write(out: RequestOutput) -> bool:
        if not writer.writable():
            return False
        events = _delta_events(fmt, 0, n, out, states)
        if events:
            writer.write(b"".join(events))
        return True

    return write


def _delta_events(fmt: _Format, prompt_index: int, n: int, out: RequestOutput,
                  states: list[_ChoiceState]) -> list[bytes]:
    """The SSE events for one engine output (of kind "delta"): new text, new logprobs (when they
    were asked for), and each choice's finish reason once; with echo, a choice's first event
    begins with its prompt."""
    base = prompt_index * n
    events = []
    echo = isinstance(fmt, _CompletionFormat) and fmt.echo_texts is not None
    for co in out.outputs:
        index = base + co.index
        st = states[index]
        lps = co.delta_token_logprobs
        finish = co.finish_reason if co.finish_reason and not st.finished else None
        echo_now = echo and not st.started  # the choice's first chunk begins with the prompt
        if not co.delta_text and not lps and finish is None and not echo_now:
            continue
        st.finished = st.finished or finish is not None
        stop_reason = co.stop_reason if finish is not None else None
        if echo_now:
            chunk = fmt.delta_chunk(index, co.delta_text, lps, st.num_sent_chars, finish, stop_reason)
            st.num_sent_chars += fmt.prepend_echo(chunk.choices[0], prompt_index, out)
            events.append(_sse(chunk))
        else:
            events.append(fmt.delta_event(index, co.delta_text, lps, st.num_sent_chars, finish, stop_reason))
        st.started = True
        st.num_sent_chars += len(co.delta_text)
    return events

