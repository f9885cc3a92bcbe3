"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) on the OpenAI
layer (``OpenAIServing``: the same templates, engine calls, tool plans, grammars and reasoning split),
so the aiohttp server and the Ray ingress both serve it, with Anthropic's error shape
(``{"type": "error", "error": {"type", "message"}}``) and its ``x-api-key`` header beside
``Authorization: Bearer``.

``system`` (a string or text blocks) and ``messages`` (text, ``tool_use``, ``tool_result`` and
``thinking`` blocks) become chat messages rendered with the model's chat template; ``tools``
(``input_schema``) and ``tool_choice`` go through the tool plans of chat completions: ``auto`` (the
server's tool-call parser), ``any`` (a grammar: one or more calls), ``tool`` (a grammar: that tool's
input), ``none``; ``disable_parallel_tool_use`` keeps one call. The reply becomes ``thinking``
(with ``--reasoning-parser``), ``text`` and ``tool_use`` blocks; ``stop_reason`` is ``end_turn``,
``max_tokens``, ``stop_sequence`` (with ``stop_sequence``) or ``tool_use``. ``stream: true`` sends
Anthropic's events: ``message_start``, per block ``content_block_start`` / ``content_block_delta``
(``text_delta``, ``thinking_delta``, ``input_json_delta``) / ``content_block_stop``, then
``message_delta`` (stop reason, usage) and ``message_stop``.

``cache_control`` (``{"type": "ephemeral", "ttl": "5m" | "1h"}``, at most 4 breakpoints, on tools,
system blocks and message blocks, or at the top level for the whole prompt) marks the prefix to keep.
The usage reports what the prefix cache did: ``cache_read_input_tokens`` the prompt tokens read from
it, ``cache_creation_input_tokens`` the marked prefix's other tokens (computed now and kept in the
cache), ``input_tokens`` the rest; the three add up to the prompt (``count_tokens``). The marked
prefix is retained for its TTL since its last use (``Retention``; kv/retention.py: a hit refreshes it,
and ``--max-retained-fraction`` bounds what all requests retain).

Refused with a 400 naming the field: images and documents, server tools, ``thinking`` with a budget
(the model thinks as its chat template says), ``output_config.effort``, ``container``, ``mcp_servers``,
``service_tier``.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from msgspec import Struct

from prefixkv.outputs import RequestOutput
from prefixkv.server.protocol import ApiRequest, ProtocolError, convert, decode_request, encode
from prefixkv.server.reasoning import ReplyParser, thinking_enabled
from prefixkv.server.tools import ToolPlan, plan_tools

if TYPE_CHECKING:
    from prefixkv.server.serving import ApiError, OpenAIServing, Reply

MESSAGES_PATH = "/v1/messages"
UNSUPPORTED = ("container", "mcp_servers", "service_tier", "context_management", "inference_geo", "diagnostics",
               "speed", "user_profile_id", "workspace_id")
TTLS = {"5m": 300.0, "1h": 3600.0}
MAX_BREAKPOINTS = 4  # Anthropic's limit on cache_control blocks
# HTTP status -> Anthropic's error type
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                529: "overloaded_error"}


def is_messages_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def messages_error_reply(e: ApiError) -> Reply:
    from prefixkv.server.serving import Reply

    return Reply(e.status, encode(_error_body(e)), headers=e.headers)


def _error_body(e: ApiError) -> dict:
    kind = _ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


# ---------------------------------------------------------------------- the request
class CacheControl(Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    ttl: str | None = None


class TextBlock(Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    text: str
    cache_control: CacheControl | None = None
    citations: list | None = None  # refused unless null


class ToolUseBlock(Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    id: str
    name: str
    input: dict
    cache_control: CacheControl | None = None


class ToolResultBlock(Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    tool_use_id: str
    content: str | list[dict] = ""
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    data: str


class InputMessage(Struct, kw_only=True, forbid_unknown_fields=True):
    role: str
    content: str | list[dict]


class Tool(Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    input_schema: dict
    description: str | None = None
    type: str | None = None  # "custom" (or absent): a client tool
    cache_control: CacheControl | None = None
    strict: bool | None = None


class ToolChoice(Struct, kw_only=True, forbid_unknown_fields=True):
    type: str  # "auto" | "any" | "tool" | "none"
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    budget_tokens: int | None = None
    display: str | None = None


class OutputFormat(Struct, kw_only=True, forbid_unknown_fields=True):
    type: str  # "json_schema"
    schema: dict | None = None


class OutputConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    format: OutputFormat | None = None
    effort: str | None = None  # refused unless null


class Metadata(Struct, kw_only=True, forbid_unknown_fields=True):
    user_id: str | None = None  # an end-user id (abuse tracking): nothing to do with the output


_Unsupported = msgspec.defstruct("_MessagesUnsupported", [(f, Any, None) for f in UNSUPPORTED], kw_only=True,
                                 forbid_unknown_fields=True, bases=(ApiRequest,))


class CountTokensRequest(_Unsupported, kw_only=True, forbid_unknown_fields=True):
    model: str
    messages: list[InputMessage]
    system: str | list[dict] | None = None
    tools: list[dict] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    cache_control: CacheControl | None = None
    output_config: OutputConfig | None = None

    def unsupported_field(self) -> str | None:
        return next((f for f in UNSUPPORTED if getattr(self, f) is not None), None)


class MessagesRequest(CountTokensRequest, kw_only=True):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None


# ---------------------------------------------------------------------- request -> chat messages
@dataclass
class _Breakpoint:
    """A block marked with cache_control: where the prefix to keep ends."""

    where: tuple  # ("tools", i) | ("system", j) | ("messages", k, l) | ("top",)
    ttl_s: float


def _cache_control(cc: CacheControl | None, path: str, marks: list[_Breakpoint], where: tuple) -> None:
    if cc is None:
        return
    if cc.type != "ephemeral":
        raise ProtocolError(f"{path}.type: must be 'ephemeral', got {cc.type!r:.40}", f"{path}.type")
    if cc.ttl is not None and cc.ttl not in TTLS:
        raise ProtocolError(f"{path}.ttl: must be '5m' or '1h', got {cc.ttl!r:.40}", f"{path}.ttl")
    if len(marks) == MAX_BREAKPOINTS:
        raise ProtocolError(f"{path}: at most {MAX_BREAKPOINTS} blocks may have cache_control", path)
    marks.append(_Breakpoint(where, TTLS[cc.ttl or "5m"]))


def _text_blocks(blocks: list[dict], path: str, marks: list[_Breakpoint] | None, where: tuple) -> list[str]:
    texts = []
    for j, raw in enumerate(blocks):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind != "text":
            raise ProtocolError(f"{path}[{j}].type: must be 'text', got {kind!r:.40}", f"{path}[{j}].type")
        b = convert(raw, TextBlock, f"{path}[{j}]")
        _no_citations(b, f"{path}[{j}]")
        if marks is not None:
            _cache_control(b.cache_control, f"{path}[{j}].cache_control", marks, (*where, j))
        texts.append(b.text)
    return texts


def _no_citations(b: TextBlock, path: str) -> None:
    if b.citations is not None:
        raise ProtocolError(f"{path}.citations: is not supported by this server", f"{path}.citations")


def chat_messages(req: CountTokensRequest, marks: list[_Breakpoint] | None = None) -> list[dict]:
    """``system`` and ``messages`` as chat messages (see the module docstring); cache_control
    breakpoints are validated and appended to ``marks``."""
    out: list[dict] = []
    if req.system is not None:
        text = req.system if isinstance(req.system, str) else "\n".join(
            _text_blocks(req.system, "system", marks, ("system",)))
        out.append({"role": "system", "content": text})
    calls: set[str] = set()
    for k, m in enumerate(req.messages):
        where = f"messages[{k}]"
        if m.role not in ("user", "assistant"):
            raise ProtocolError(f"{where}.role: must be 'user' or 'assistant', got {m.role!r:.40}", f"{where}.role")
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts: list[str] = []
        tool_calls: list[dict] = []
        reasoning: list[str] = []
        results: list[dict] = []
        for j, raw in enumerate(m.content):
            path = f"{where}.content[{j}]"
            kind = raw.get("type") if isinstance(raw, dict) else None
            allowed = ("text", "tool_result") if m.role == "user" else ("text", "tool_use", "thinking",
                                                                        "redacted_thinking")
            if kind not in allowed:
                raise ProtocolError(f"{path}.type: {kind!r:.40} is not supported in a {m.role} message (this server "
                                    f"takes {', '.join(allowed)} blocks there)", f"{path}.type")
            if kind == "text":
                b = convert(raw, TextBlock, path)
                _no_citations(b, path)
                texts.append(b.text)
                cc = b.cache_control
            elif kind == "tool_use":
                b = convert(raw, ToolUseBlock, path)
                tool_calls.append({"id": b.id, "type": "function",
                                   "function": {"name": b.name, "arguments": json.dumps(b.input)}})
                calls.add(b.id)
                cc = b.cache_control
            elif kind == "tool_result":
                b = convert(raw, ToolResultBlock, path)
                if b.tool_use_id not in calls:
                    raise ProtocolError(f"{path}.tool_use_id: {b.tool_use_id!r} is not the id of a tool_use block of "
                                        "an earlier assistant message", f"{path}.tool_use_id")
                content = b.content if isinstance(b.content, str) else "\n".join(
                    _text_blocks(b.content, f"{path}.content", None, ()))
                results.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                "content": f"Error: {content}" if b.is_error else content})
                cc = b.cache_control
            elif kind == "thinking":
                reasoning.append(convert(raw, ThinkingBlock, path).thinking)
                cc = None
            else:  # redacted_thinking: opaque (encrypted by Anthropic); nothing a template can render
                convert(raw, RedactedThinkingBlock, path)
                cc = None
            if marks is not None:
                _cache_control(cc, f"{path}.cache_control", marks, ("messages", k, j))
        out.extend(results)  # tool results first: they answer the calls of the turn before
        if texts or tool_calls or reasoning or not results:
            msg: dict[str, Any] = {"role": m.role, "content": "".join(texts) if texts or not tool_calls else None}
            if tool_calls:
                msg["tool_calls"] = tool_calls
            if reasoning:
                msg["reasoning_content"] = "".join(reasoning)
            out.append(msg)
    return out


def _truncated(req: CountTokensRequest, mark: _Breakpoint) -> CountTokensRequest:
    """The request cut after the block ``mark`` marks (what the cached prefix holds)."""
    if mark.where[0] == "messages":
        _, k, j = mark.where
        last = req.messages[k]
        messages = req.messages[:k] + [InputMessage(role=last.role, content=last.content[:j + 1])]
        return msgspec.structs.replace(req, messages=messages)
    system = req.system
    if mark.where[0] == "system":
        system = req.system[:mark.where[1] + 1]
    elif mark.where[0] == "tools":
        system = None
    # a one-character user turn after it: where the rendered prompts part is where the prefix ends
    return msgspec.structs.replace(req, system=system, messages=[InputMessage(role="user", content="\x00")])


def _tools(req: CountTokensRequest, marks: list[_Breakpoint]) -> tuple[list[dict] | None, Any, bool | None]:
    """Anthropic's tools and tool_choice -> chat's (for ``plan_tools``)."""
    tools = None
    if req.tools is not None:
        tools = []
        for i, raw in enumerate(req.tools):
            kind = raw.get("type") if isinstance(raw, dict) else None
            if kind not in (None, "custom"):
                raise ProtocolError(f"tools[{i}].type: {kind!r:.40} is not supported (client tools with an "
                                    "input_schema only)", f"tools[{i}].type")
            t = convert(raw, Tool, f"tools[{i}]")
            _cache_control(t.cache_control, f"tools[{i}].cache_control", marks, ("tools", i))
            fn = {"name": t.name, "parameters": t.input_schema, "description": t.description, "strict": t.strict}
            tools.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    tc = req.tool_choice
    if tc is None:
        return tools, None, None
    parallel = False if tc.disable_parallel_tool_use else None
    if tc.type == "tool":
        if tc.name is None:
            raise ProtocolError("tool_choice.name: is required for type 'tool'", "tool_choice.name")
        return tools, {"type": "function", "function": {"name": tc.name}}, parallel
    choice = {"auto": "auto", "any": "required", "none": "none"}.get(tc.type)
    if choice is None or tc.name is not None:
        raise ProtocolError(f"tool_choice.type: must be 'auto', 'any', 'tool' or 'none', got {tc.type!r:.40}",
                            "tool_choice.type")
    return tools, choice, parallel


def _tool_error(e: ProtocolError) -> ProtocolError:
    """plan_tools names chat's fields: name Anthropic's."""
    param = (e.param or "").replace(".function.parameters", ".input_schema").replace(".function.", ".")
    return ProtocolError(param + e.message[len(e.param or ""):], param or None)


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


# ---------------------------------------------------------------------- the reply
@dataclass
class _Blocks:
    """The reply's content blocks as its deltas arrive, and their stream events."""

    parser: ReplyParser
    blocks: list[dict] = field(default_factory=list)
    _open: dict | None = None
    _args: str = ""  # the open tool_use block's input JSON so far

    def feed(self, text: str, final: bool) -> list[bytes]:
        reasoning, content, calls = self.parser.close() if final else self.parser.feed(text)
        events: list[bytes] = []
        if reasoning:
            events += self._text("thinking", reasoning)
        if content:
            events += self._text("text", content)
        for d in calls:
            if d.id is not None:
                events += self._close()
                block = {"type": "tool_use", "id": d.id, "name": d.function.name, "input": {}}
                events += self._start(block)
            if d.function is not None and d.function.arguments:
                self._args += d.function.arguments
                events.append(_event("content_block_delta", index=len(self.blocks) - 1,
                                     delta={"type": "input_json_delta", "partial_json": d.function.arguments}))
        if final:
            events += self._close()
        return events

    def _text(self, kind: str, text: str) -> list[bytes]:
        events: list[bytes] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            events += self._start({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                                  else {"type": "text", "text": ""})
        self._open[kind] += text
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {"type": "text_delta",
                                                                                          "text": text}
        events.append(_event("content_block_delta", index=len(self.blocks) - 1, delta=delta))
        return events

    def _start(self, block: dict) -> list[bytes]:
        self.blocks.append(block)
        self._open = block
        return [_event("content_block_start", index=len(self.blocks) - 1, content_block=dict(block))]

    def _close(self) -> list[bytes]:
        block, self._open = self._open, None
        if block is None:
            return []
        if block["type"] == "tool_use":
            block["input"] = _object(self._args)
            self._args = ""
        events = []
        if block["type"] == "thinking":  # (no signature: nothing signs this server's thinking)
            events.append(_event("content_block_delta", index=len(self.blocks) - 1,
                                 delta={"type": "signature_delta", "signature": ""}))
        return events + [_event("content_block_stop", index=len(self.blocks) - 1)]


def _object(arguments: str) -> dict:
    """A call's input: its JSON object (a call cut by max_tokens is not one: {})."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _event(kind: str, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + encode({"type": kind, **fields}) + b"\n\n"


# ---------------------------------------------------------------------- the routes
@dataclass
class _Plan:
    req: MessagesRequest
    id: str
    prompt_ids: list[int]
    num_marked: int  # the prompt tokens up to the last cache_control breakpoint (0: none)
    ttl_s: float | None
    params: Any  # SamplingParams
    aliases: dict[str, str]
    tools: ToolPlan | None
    reasoning: bool


class MessagesServing:
    """The Messages routes over an ``OpenAIServing``. Every error they raise is an ``ApiError``;
    the transport answers it in Anthropic's shape (``OpenAIServing.error_reply``)."""

    def __init__(self, api: OpenAIServing) -> None:
        self.api = api

    async def count_tokens(self, body: bytes) -> Reply:
        from prefixkv.server.serving import json_reply

        req = decode_request(body, CountTokensRequest)
        ids, _, _, _, _ = await self._render(req)
        return json_reply({"input_tokens": len(ids)})

    async def create(self, body: bytes, t0: float) -> Reply:
        from prefixkv.server.serving import SSE_HEADERS, EventStream, Reply, Retention, json_reply

        plan = await self._plan(decode_request(body, MessagesRequest))
        deadline = t0 + self.api.config.request_timeout
        retention = Retention(plan.num_marked, plan.ttl_s) if plan.num_marked else None
        stream = await self.api.start(plan.req, plan.id, plan.prompt_ids, plan.params, plan.aliases, deadline,
                                      retention)
        blocks = _Blocks(ReplyParser(plan.tools, plan.reasoning))
        if plan.req.stream:
            return Reply(200, content_type="text/event-stream", headers=dict(SSE_HEADERS),
                         stream=EventStream(self._events(plan, blocks, stream, t0, deadline), [stream]))
        loop = asyncio.get_running_loop()
        final, ttft = None, None
        try:
            async for out in self.api.outputs(stream, deadline):
                ttft = ttft if ttft is not None else loop.time() - t0
                blocks.feed(out.outputs[0].delta_text, final=False)
                final = out
        finally:
            stream.abort()
        blocks.feed("", final=True)
        stop_reason, stop_sequence = self._stop(plan, blocks, final)
        return json_reply({"id": plan.id, "type": "message", "role": "assistant", "model": self.api.config.model_name,
                           "content": blocks.blocks, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                           "usage": self._usage(plan, final, self.api.observe(t0, ttft, [final]).completion_tokens)})

    async def _events(self, plan: _Plan, blocks: _Blocks, stream: Any, t0: float,
                      deadline: float) -> AsyncIterator[bytes]:
        from prefixkv.server.serving import ApiError

        loop = asyncio.get_running_loop()
        final, ttft = None, None
        try:
            async for out in self.api.outputs(stream, deadline):
                events = []
                if ttft is None:  # message_start: once the prompt's cached part is known
                    ttft = loop.time() - t0
                    message = {"id": plan.id, "type": "message", "role": "assistant", "content": [],
                               "model": self.api.config.model_name, "stop_reason": None, "stop_sequence": None,
                               "usage": self._usage(plan, out, 0)}
                    events.append(_event("message_start", message=message))
                final = out
                events += blocks.feed(out.outputs[0].delta_text, final=False)
                if events:
                    yield b"".join(events)
        except ApiError as e:
            yield _event("error", error=_error_body(e)["error"])
            return
        events = blocks.feed("", final=True)
        stop_reason, stop_sequence = self._stop(plan, blocks, final)
        usage = self._usage(plan, final, self.api.observe(t0, ttft, [final]).completion_tokens)
        events.append(_event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                             usage=usage))
        events.append(_event("message_stop"))
        yield b"".join(events)

    @staticmethod
    def _stop(plan: _Plan, blocks: _Blocks, final: RequestOutput) -> tuple[str, str | None]:
        co = final.outputs[0]
        if co.finish_reason == "length":
            return "max_tokens", None
        if blocks.parser.calls:
            return "tool_use", None
        if isinstance(co.stop_reason, str):
            return "stop_sequence", co.stop_reason
        return "end_turn", None

    @staticmethod
    def _usage(plan: _Plan, out: RequestOutput, num_output: int) -> dict:
        num_read = out.num_cached_tokens
        num_created = max(0, plan.num_marked - num_read)
        return {"input_tokens": out.num_prompt_tokens - num_read - num_created, "output_tokens": num_output,
                "cache_creation_input_tokens": num_created, "cache_read_input_tokens": num_read}

    async def _render(self, req: CountTokensRequest) -> tuple[list[int], int, float | None, ToolPlan | None, dict]:
        """The prompt's token ids, the length of its prefix marked with cache_control (and the
        longest TTL asked), and the tool plan."""
        from prefixkv.server.serving import ApiError

        api = self.api
        api._check_model(req.model)
        bad = req.unsupported_field()
        if bad is not None:
            raise ApiError(400, f"{bad}: is not supported by this server", param=bad)
        template_kwargs = None
        if req.thinking is not None:
            if req.thinking.type != "disabled":
                raise ApiError(400, "thinking.type: only 'disabled' is supported: a thinking budget is not (the model "
                                    "thinks as its chat template says, and --reasoning-parser shows it as thinking "
                                    "blocks); omit thinking", param="thinking.type")
            template_kwargs = {"enable_thinking": False}
        marks: list[_Breakpoint] = []
        tools_in, choice, parallel = _tools(req, marks)
        messages = chat_messages(req, marks)
        if req.cache_control is not None:
            _cache_control(req.cache_control, "cache_control", marks, ("top",))
        try:
            tools = plan_tools(tools_in, choice, parallel, api.tool_call_parser)
        except ProtocolError as e:
            raise _tool_error(e) from None
        rendered_tools = tools.tools if tools else None
        ids = await api.render_chat(messages, rendered_tools, template_kwargs)
        num_marked, ttl = 0, None
        if marks:
            ttl = max(m.ttl_s for m in marks)
            if any(m.where[0] == "top" for m in marks):
                num_marked = len(ids)
            else:
                order = ("tools", "system", "messages")
                last = max(marks, key=lambda m: (order.index(m.where[0]), m.where[1:]))
                cut = _truncated(req, last)
                prefix = await api.render_chat(chat_messages(cut), rendered_tools, template_kwargs)
                num_marked = _lcp(ids, prefix)
        return ids, num_marked, ttl, tools, template_kwargs or {}

    async def _plan(self, req: MessagesRequest) -> _Plan:
        ids, num_marked, ttl, tools, template_kwargs = await self._render(req)
        aliases = {"stop": "stop_sequences"}
        kw: dict[str, Any] = dict(max_tokens=req.max_tokens, stop=req.stop_sequences, temperature=req.temperature,
                                  top_p=req.top_p, top_k=req.top_k, output_kind="delta")
        so = None
        oc = req.output_config
        if oc is not None:
            from prefixkv.server.serving import ApiError

            if oc.effort is not None:
                raise ApiError(400, "output_config.effort: is not supported by this server",
                               param="output_config.effort")
            if oc.format is not None:
                if oc.format.type != "json_schema" or not isinstance(oc.format.schema, dict):
                    raise ApiError(400, "output_config.format: must be {'type': 'json_schema', 'schema': {...}}",
                                   param="output_config.format")
                so = {"json": oc.format.schema}
                aliases["structured_outputs.json"] = "output_config.format.schema"
        from prefixkv.server.serving import constrain_to_tools

        so = constrain_to_tools(so, tools, aliases, "output_config.format", "tool_choice 'any' or 'tool'",
                                lambda v: v.replace(".function.parameters", ".input_schema"))
        if so is not None:
            kw["structured_outputs"] = so
        params = self.api.sampling_params(kw, aliases)
        reasoning = thinking_enabled(self.api.config.reasoning_parser, template_kwargs, params.structured_outputs)
        return _Plan(req, f"msg_{uuid.uuid4().hex}", ids, num_marked, ttl, params, aliases, tools, reasoning)
