"""OpenAI's Responses API (``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``) on the
OpenAI layer (``OpenAIServing``: the same template rendering, engine calls, tool plans, grammars and
reasoning split as chat completions), so the aiohttp server and the Ray ingress both serve it.

A request's ``input`` (a string, or items: messages, ``function_call`` and ``function_call_output``
items, ``reasoning`` items) and ``instructions`` become chat messages rendered with the model's chat
template; the reply is split (server/reasoning.py) into output items: ``reasoning``, ``message``
(``output_text``) and ``function_call`` items. ``stream: true`` sends Responses' event sequence
(``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` / ``response.reasoning_text.delta`` /
``response.function_call_arguments.delta``, their ``.done`` events, ``response.completed`` or
``response.incomplete``), each ``event: <type>`` with a ``sequence_number``; the last event's
response equals the non-streamed one.

``store`` (default true, as OpenAI's): the response and its conversation (the input, less
``instructions``, and the output) are kept in ``ResponseStore``, bounded by count and bytes (least
recently used dropped first), so ``previous_response_id`` continues the conversation: its prompt
begins with the stored turn's prompt and reply, whose KV blocks the prefix cache holds (the usage's
``input_tokens_details.cached_tokens`` counts them). The stored conversation's prefix is asked to be
retained (``Retention``: the whole prompt, for ``serving.STORED_RETENTION_TTL_S`` since its last use,
which a continuation refreshes; kv/retention.py), held under the response's id. A response the store
forgets (``DELETE``, dropped beyond its bounds, or never stored: too large, or the request failed)
releases that retention through the engine (``CacheControl.release_retention``), before the
``DELETE`` is answered (through the Ray ingress, every replica releases it within a routing-stats
period: serve/control_log.py); what a continuation retained under its own id stays, so deleting the
first turn of a chain keeps the prefix the later turns cover. The store lives in the serving
process (each Ray ingress replica has its own).

Refused with a 400 naming the field: built-in tools (web search, file search, ...), ``background``,
``reasoning`` (effort), ``include``, ``top_logprobs``, ``truncation: "auto"``, stored prompts,
conversations objects, images and files in the input.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from msgspec import Struct

from prefixkv.engine_client import CacheControl
from prefixkv.outputs import RequestOutput
from prefixkv.server.protocol import ApiRequest, ProtocolError, convert, decode_request, encode
from prefixkv.server.reasoning import ReplyParser, thinking_enabled
from prefixkv.server.tools import ToolPlan, plan_tools

if TYPE_CHECKING:
    from prefixkv.server.serving import OpenAIServing, Reply

logger = logging.getLogger(__name__)

# known fields of OpenAI's request that this server does not implement: a non-null value is a 400
UNSUPPORTED = ("background", "include", "reasoning", "top_logprobs", "prompt", "conversation", "service_tier",
               "max_tool_calls", "prompt_cache_retention", "stream_options", "context_management", "moderation")


class TextPart(Struct, kw_only=True, forbid_unknown_fields=True):
    type: str  # "input_text" | "output_text" (an earlier reply sent back) | "reasoning_text"
    text: str
    annotations: list | None = None  # (output_text)
    logprobs: list | None = None  # (output_text)


class MessageItem(Struct, kw_only=True, forbid_unknown_fields=True):
    role: str
    content: str | list[dict]
    type: str = "message"
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class FunctionCallItem(Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    call_id: str
    output: str | list[dict]
    id: str | None = None
    status: str | None = None


class ReasoningItem(Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    summary: list[dict] = []
    content: list[dict] | None = None
    id: str | None = None
    encrypted_content: str | None = None
    status: str | None = None


class FunctionTool(Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    name: str
    parameters: dict | None = None
    strict: bool | None = None
    description: str | None = None


class TextFormat(Struct, kw_only=True, forbid_unknown_fields=True):
    type: str  # "text" | "json_object" | "json_schema"
    name: str | None = None
    schema: dict | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    format: TextFormat | None = None
    verbosity: str | None = None  # refused unless null


_Unsupported = msgspec.defstruct("_ResponsesUnsupported", [(f, Any, None) for f in UNSUPPORTED], kw_only=True,
                                 forbid_unknown_fields=True, bases=(ApiRequest,))


class ResponsesRequest(_Unsupported, kw_only=True, forbid_unknown_fields=True):
    input: str | list[dict]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    truncation: str | None = None  # "disabled" (the default) only
    user: str | None = None  # end-user ids for abuse tracking (OpenAI's): nothing to do with the output
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # a cache-routing hint: this server's prefix cache needs none

    def unsupported_field(self) -> str | None:
        return next((f for f in UNSUPPORTED if getattr(self, f) is not None), None)


# ---------------------------------------------------------------------- the store
@dataclass
class _Stored:
    response: dict  # the response object, as GET returns it
    conversation: list[dict]  # chat messages: the input (without instructions) and the output
    num_bytes: int


class ResponseStore:
    """Stored responses by id, least recently used first out when either bound is passed
    (``max_responses``, ``max_bytes`` of their JSON). ``on_drop(id)`` is told of every response
    forgotten (deleted, dropped beyond the bounds, or too large to be kept). Used from the event
    loop only."""

    def __init__(self, max_responses: int, max_bytes: int, on_drop: Callable[[str], None] | None = None) -> None:
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self.on_drop = on_drop
        self._items: OrderedDict[str, _Stored] = OrderedDict()
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._items

    def put(self, response: dict, conversation: list[dict]) -> None:
        size = len(encode(response)) + len(encode(conversation))
        if size > self.max_bytes or self.max_responses == 0:
            # larger than the whole store: not kept (GET and previous_response_id answer "not found")
            if self.on_drop is not None:
                self.on_drop(response["id"])
            return
        self._forget(response["id"])
        self._items[response["id"]] = _Stored(response, conversation, size)
        self.num_bytes += size
        while len(self._items) > self.max_responses or self.num_bytes > self.max_bytes:
            self.drop(next(iter(self._items)))

    def get(self, response_id: str) -> _Stored | None:
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)
        return item

    def drop(self, response_id: str) -> bool:
        """Forget a response (deleted, or the least recently used beyond the bounds) and tell
        ``on_drop``; False if it is not stored."""
        if not self._forget(response_id):
            return False
        if self.on_drop is not None:
            self.on_drop(response_id)
        return True

    def _forget(self, response_id: str) -> bool:
        item = self._items.pop(response_id, None)
        if item is None:
            return False
        self.num_bytes -= item.num_bytes
        return True


# ---------------------------------------------------------------------- input -> chat messages
def _text_of(content: str | list[dict], path: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for j, raw in enumerate(content):
        where = f"{path}[{j}]"
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind not in ("input_text", "output_text", "reasoning_text"):
            raise ProtocolError(f"{where}.type: {kind!r:.40} is not supported (text parts only: input_text, "
                                "output_text)", f"{where}.type")
        parts.append(convert(raw, TextPart, where).text)
    return "".join(parts)


def input_messages(inp: str | list[dict], known_calls: set[str]) -> list[dict]:
    """``input`` as chat messages (see the module docstring); ``known_calls``: the call ids of the
    stored conversation it continues (a function_call_output answers one of them or of its own)."""
    if isinstance(inp, str):
        return [{"role": "user", "content": inp}]
    if not inp:
        raise ProtocolError("input: must be a non-empty string or list of items", "input")
    messages: list[dict] = []
    calls = set(known_calls)
    reasoning: str | None = None  # a reasoning item goes with the assistant turn that follows it
    for i, raw in enumerate(inp):
        where = f"input[{i}]"
        kind = raw.get("type", "message") if isinstance(raw, dict) else None
        if kind == "message":
            item = convert(raw, MessageItem, where)
            if item.role not in ("user", "assistant", "system", "developer"):
                raise ProtocolError(f"{where}.role: must be 'user', 'assistant', 'system' or 'developer', got "
                                    f"{item.role!r:.40}", f"{where}.role")
            msg = {"role": "system" if item.role == "developer" else item.role,
                   "content": _text_of(item.content, f"{where}.content")}
            if item.role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            messages.append(msg)
        elif kind == "function_call":
            item = convert(raw, FunctionCallItem, where)
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name,
                                                                          "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # one turn: its text and its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                if reasoning is not None:
                    messages[-1]["reasoning_content"], reasoning = reasoning, None
            calls.add(item.call_id)
        elif kind == "function_call_output":
            item = convert(raw, FunctionCallOutputItem, where)
            if item.call_id not in calls:
                raise ProtocolError(f"{where}.call_id: {item.call_id!r} is not the call_id of a function_call "
                                    "earlier in the conversation", f"{where}.call_id")
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _text_of(item.output, f"{where}.output")})
        elif kind == "reasoning":
            item = convert(raw, ReasoningItem, where)
            if item.encrypted_content is not None:
                raise ProtocolError(f"{where}.encrypted_content: is not supported", f"{where}.encrypted_content")
            reasoning = _text_of(item.content or [], f"{where}.content")
        else:
            raise ProtocolError(f"{where}.type: {kind!r:.40} is not supported (message, function_call, "
                                "function_call_output and reasoning items are)", f"{where}.type")
    return messages


def _call_ids(conversation: list[dict]) -> set[str]:
    return {c["id"] for m in conversation for c in m.get("tool_calls") or ()}


def _tools(req: ResponsesRequest) -> tuple[list[dict] | None, Any]:
    """Responses' function tools and tool_choice -> chat's (for ``plan_tools``)."""
    tools = None
    if req.tools:
        tools = []
        for i, raw in enumerate(req.tools):
            kind = raw.get("type") if isinstance(raw, dict) else None
            if kind != "function":
                raise ProtocolError(f"tools[{i}].type: {kind!r:.40} is not supported (function tools only; built-in "
                                    "tools such as web_search run on OpenAI's servers)", f"tools[{i}].type")
            t = convert(raw, FunctionTool, f"tools[{i}]")
            fn = {"name": t.name, "parameters": t.parameters, "description": t.description, "strict": t.strict}
            tools.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str) or set(choice) != {"type",
                                                                                                          "name"}:
            raise ProtocolError("tool_choice: must be 'none', 'auto', 'required' or {'type': 'function', "
                                "'name': ...}", "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools, choice


def _tool_error(e: ProtocolError) -> ProtocolError:
    """plan_tools names chat's fields (tools[0].function.name, tool_choice.function.name): name
    Responses' (tools[0].name, tool_choice.name)."""
    param = (e.param or "").replace(".function.", ".")
    return ProtocolError(param + e.message[len(e.param or ""):], param or None)


# ---------------------------------------------------------------------- the reply
def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _Reply:
    """One response's output items as the reply's deltas arrive, and its stream events."""

    parser: ReplyParser
    items: list[dict] = field(default_factory=list)
    num_events: int = 0
    _open: dict | None = None  # the item being written

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.num_events, **fields}
        self.num_events += 1
        return b"event: " + kind.encode() + b"\ndata: " + encode(body) + b"\n\n"

    def feed(self, text: str, final: bool) -> list[bytes]:
        reasoning, content, calls = self.parser.close() if final else self.parser.feed(text)
        if final and text:
            raise AssertionError("feed the last text before closing")
        events: list[bytes] = []
        if reasoning:
            events += self._text("reasoning", reasoning)
        if content:
            events += self._text("message", content)
        for d in calls:
            if d.id is not None:  # a new call
                events += self._close()
                item = {"id": _new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": d.id,
                        "name": d.function.name, "arguments": ""}
                events += self._open_item(item)
            if d.function is not None and d.function.arguments:
                self._open["arguments"] += d.function.arguments
                events.append(self.event("response.function_call_arguments.delta", item_id=self._open["id"],
                                         output_index=len(self.items) - 1, delta=d.function.arguments))
        return events

    def finish(self, status: str) -> list[bytes]:
        events = self.feed("", final=True)
        return events + self._close(status)

    def _text(self, kind: str, text: str) -> list[bytes]:
        events: list[bytes] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            if kind == "reasoning":
                item = {"id": _new_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
                part = {"type": "reasoning_text", "text": ""}
            else:
                item = {"id": _new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                        "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events += self._open_item(item)
            item["content"].append(part)
            events.append(self.event("response.content_part.added", item_id=item["id"],
                                     output_index=len(self.items) - 1, content_index=0, part=dict(part)))
        part = self._open["content"][0]
        part["text"] += text
        extra = {"logprobs": []} if kind == "message" else {}
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        events.append(self.event(name, item_id=self._open["id"], output_index=len(self.items) - 1, content_index=0,
                                 delta=text, **extra))
        return events

    def _open_item(self, item: dict) -> list[bytes]:
        self.items.append(item)
        self._open = item
        shown = {**item, "content": []} if "content" in item else dict(item)
        return [self.event("response.output_item.added", output_index=len(self.items) - 1, item=shown)]

    def _close(self, status: str = "completed") -> list[bytes]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status if item["type"] != "function_call" else "completed"
        index, events = len(self.items) - 1, []
        if item["type"] == "function_call":
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                     name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            if item["type"] == "message":
                events.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                         content_index=0, text=part["text"], logprobs=[]))
            else:
                events.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                         content_index=0, text=part["text"]))
            events.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                     content_index=0, part=part))
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events


# ---------------------------------------------------------------------- the routes
@dataclass
class _Plan:
    """A validated request, ready for the engine."""

    req: ResponsesRequest
    id: str
    conversation: list[dict]  # the messages rendered (without instructions)
    prompt_ids: list[int]
    params: Any  # SamplingParams
    aliases: dict[str, str]
    tools: ToolPlan | None
    reasoning: bool
    created_at: int = field(default_factory=lambda: int(time.time()))


class ResponsesServing:
    """The Responses routes over an ``OpenAIServing`` (its engine calls, templates, metrics)."""

    def __init__(self, api: OpenAIServing) -> None:
        self.api = api
        # ids whose retentions the engine is yet to release (``release_retentions``)
        self._to_release: list[str] = []
        self._cache = api.engine if isinstance(api.engine, CacheControl) else None
        self.store = ResponseStore(api.config.max_stored_responses, api.config.max_stored_response_bytes,
                                   self._to_release.append if self._cache is not None else None)

    async def release_retentions(self) -> None:
        """Release, through the engine, the retentions of the responses forgotten since the last
        call (the store's ``on_drop``, and requests that ended unstored). An engine error is
        logged, never raised: the retention then lapses with its TTL."""
        handles, self._to_release[:] = list(self._to_release), []
        for handle in handles:
            try:
                await self._cache.release_retention(handle)
            except Exception as e:  # a dead or stopping engine: nothing to keep anyway
                logger.warning("releasing the retention of stored response %s: %s: %s", handle,
                               type(e).__name__, e)
                return

    def _unstored(self, plan: _Plan) -> None:
        """A request that asked for retention under its id ended without being stored."""
        if self._cache is not None and plan.req.store is not False and plan.id not in self.store \
                and plan.id not in self._to_release:
            self._to_release.append(plan.id)

    def get(self, response_id: str) -> Reply:
        from prefixkv.server.serving import json_reply

        item = self.store.get(response_id)
        if item is None:
            raise self._not_found(response_id, "response_id")
        return json_reply(item.response)

    async def delete(self, response_id: str) -> Reply:
        """Forget a stored response and release its retention (with what else the store dropped)
        before answering."""
        from prefixkv.server.serving import json_reply

        if not self.store.drop(response_id):
            raise self._not_found(response_id, "response_id")
        await self.release_retentions()
        return json_reply({"id": response_id, "object": "response.deleted", "deleted": True})

    @staticmethod
    def _not_found(response_id: str, param: str, status: int = 404) -> Exception:
        from prefixkv.server.serving import ApiError

        return ApiError(status, f"{param}: no stored response with id {response_id!r} (never stored, deleted, or "
                                "dropped from the server's bounded store)", param=param, code="response_not_found")

    async def create(self, body: bytes, t0: float) -> Reply:
        from prefixkv.server.serving import SSE_HEADERS, EventStream, Reply, json_reply

        plan = await self._plan(decode_request(body, ResponsesRequest))
        deadline = t0 + self.api.config.request_timeout
        retention = None
        if plan.req.store is not False:
            from prefixkv.server.serving import Retention

            # (named only where it can be released: a handle no one releases is held until its prefix lapses)
            retention = Retention(num_tokens=None, ttl_s=None, handle=plan.id if self._cache is not None else None)
        stream = await self.api.start(plan.req, plan.id, plan.prompt_ids, plan.params, plan.aliases, deadline,
                                      retention)
        reply = _Reply(ReplyParser(plan.tools, plan.reasoning))
        if plan.req.stream:
            return Reply(200, content_type="text/event-stream", headers=dict(SSE_HEADERS),
                         stream=EventStream(self._events(plan, reply, stream, t0, deadline), [stream]))
        loop = asyncio.get_running_loop()
        try:
            final, ttft = None, None
            async for out in self.api.outputs(stream, deadline):
                ttft = ttft if ttft is not None else loop.time() - t0
                reply.feed(out.outputs[0].delta_text, final=False)
                final = out
            reply.finish(_status(final))
            response = self._finished(plan, reply, final, t0, ttft)
        finally:
            stream.abort()
            self._unstored(plan)
        await self.release_retentions()
        return json_reply(response)

    async def _events(self, plan: _Plan, reply: _Reply, stream: Any, t0: float,
                      deadline: float) -> AsyncIterator[bytes]:
        from prefixkv.server.serving import ApiError

        shell = self._response(plan, [], "in_progress", None, None)
        final, ttft = None, None
        loop = asyncio.get_running_loop()
        try:
            yield reply.event("response.created", response=shell) + reply.event("response.in_progress",
                                                                                 response=shell)
            try:
                async for out in self.api.outputs(stream, deadline):
                    ttft = ttft if ttft is not None else loop.time() - t0
                    final = out
                    events = reply.feed(out.outputs[0].delta_text, final=False)
                    if events:
                        yield b"".join(events)
            except ApiError as e:
                failed = self._response(plan, reply.items, "failed", None, None)
                failed["error"] = {"code": e.code or "server_error", "message": e.message}
                yield reply.event("response.failed", response=failed)
                return
            status = _status(final)
            events = reply.finish(status)
            response = self._finished(plan, reply, final, t0, ttft)
        finally:  # (a client gone mid-stream too: its release goes with the next call)
            self._unstored(plan)
        await self.release_retentions()
        yield b"".join(events) + reply.event(f"response.{status}", response=response)

    def _finished(self, plan: _Plan, reply: _Reply, final: RequestOutput, t0: float, ttft: float | None) -> dict:
        """The response once the request finished; stored (with its conversation) unless store is false."""
        status = _status(final)
        usage = self.api.observe(t0, ttft, [final])
        reasoning = reply.parser.reasoning
        num_reasoning = len(self.api.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        response = self._response(plan, reply.items, status, usage, num_reasoning)
        if plan.req.store is not False:
            turn: dict[str, Any] = {"role": "assistant", "content": reply.parser.content}
            if reasoning:
                turn["reasoning_content"] = reasoning
            if reply.parser.calls:
                turn["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name,
                                                                                     "arguments": c.arguments}}
                                      for c in reply.parser.calls]
            self.store.put(response, plan.conversation + [turn])
        return response

    def _response(self, plan: _Plan, items: list[dict], status: str, usage: Any, num_reasoning: int | None) -> dict:
        req = plan.req
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        tool_choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
        out = {
            "id": plan.id, "object": "response", "created_at": plan.created_at, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": self.api.config.model_name, "output": [dict(i) for i in items],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "reasoning": None, "store": req.store is not False,
            "temperature": plan.params.temperature, "top_p": plan.params.top_p,
            "text": {"format": msgspec.to_builtins(fmt) if fmt is not None else {"type": "text"}},
            "tool_choice": tool_choice, "tools": req.tools or [], "truncation": "disabled", "user": req.user,
            "metadata": req.metadata or {}, "usage": None,
        }
        if usage is not None:
            out["usage"] = {"input_tokens": usage.prompt_tokens,
                            "input_tokens_details": {"cached_tokens": usage.prompt_tokens_details.cached_tokens},
                            "output_tokens": usage.completion_tokens,
                            "output_tokens_details": {"reasoning_tokens": num_reasoning or 0},
                            "total_tokens": usage.total_tokens}
        return out

    async def _plan(self, req: ResponsesRequest) -> _Plan:
        from prefixkv.server.serving import ApiError, constrain_to_tools

        api = self.api
        api._check_model(req.model)
        bad = req.unsupported_field()
        if bad is not None:
            raise ApiError(400, f"{bad}: is not supported by this server", param=bad)
        if req.truncation not in (None, "disabled"):
            raise ApiError(400, "truncation: only 'disabled' is supported (a conversation longer than the context "
                                "is a 400)", param="truncation")
        if req.text is not None and req.text.verbosity is not None:
            raise ApiError(400, "text.verbosity: is not supported by this server", param="text.verbosity")
        history: list[dict] = []
        if req.previous_response_id is not None:
            prev = self.store.get(req.previous_response_id)
            if prev is None:
                raise self._not_found(req.previous_response_id, "previous_response_id", status=400)
            history = [dict(m) for m in prev.conversation]
        conversation = history + input_messages(req.input, _call_ids(history))
        messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
        tools_in, choice = _tools(req)
        try:
            tools = plan_tools(tools_in, choice, req.parallel_tool_calls, api.tool_call_parser)
        except ProtocolError as e:
            raise _tool_error(e) from None
        aliases = {"max_tokens": "max_output_tokens", "messages": "input"}
        kw: dict[str, Any] = dict(max_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p,
                                  output_kind="delta")
        so = constrain_to_tools(_format_constraint(req, aliases), tools, aliases, "text.format",
                                "tool_choice 'required' or a named function", lambda v: v.replace(".function.", "."))
        if so is not None:
            kw["structured_outputs"] = so
        params = api.sampling_params(kw, aliases)
        prompt_ids = await api.render_chat(messages, tools.tools if tools else None, None, aliases)
        reasoning = thinking_enabled(api.config.reasoning_parser, None, params.structured_outputs)
        return _Plan(req, _new_id("resp"), conversation, prompt_ids, params, aliases, tools, reasoning)


def _format_constraint(req: ResponsesRequest, aliases: dict[str, str]) -> dict | None:
    """``text.format`` as structured outputs (the grammar we have)."""
    from prefixkv.server.serving import ApiError

    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        aliases["structured_outputs.json_object"] = "text.format"
        return {"json_object": True}
    if fmt.type == "json_schema":
        if not isinstance(fmt.schema, dict):
            raise ApiError(400, "text.format.schema: a JSON schema object is required for type 'json_schema'",
                           param="text.format.schema")
        aliases["structured_outputs.json"] = "text.format.schema"
        return {"json": fmt.schema}
    raise ApiError(400, f"text.format.type: must be 'text', 'json_object' or 'json_schema', got {fmt.type!r:.40}",
                   param="text.format.type")


def _status(final: RequestOutput | None) -> str:
    return "incomplete" if final is not None and final.outputs[0].finish_reason == "length" else "completed"

