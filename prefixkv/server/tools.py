"""Tool calling on /v1/chat/completions (OpenAI's ``tools`` / ``tool_choice``), as vLLM does it.

How the reply becomes tool calls depends on ``tool_choice``:

- ``"none"``: the tools are rendered into the prompt; the reply is text.
- a named function (``{"type": "function", "function": {"name": N}}``): the reply is constrained
  (structured outputs) to N's ``parameters`` schema and is that call's arguments. finish_reason
  "stop", as OpenAI answers a forced function.
- ``"required"``: the reply is constrained to a JSON array of one or more (exactly one when
  ``parallel_tool_calls`` is false) ``{"name": <a tool>, "parameters": <its schema>}``; each item is
  a call. finish_reason "tool_calls".
- ``"auto"`` (the default when tools are given): the model's free reply is parsed by the server's
  ``--tool-call-parser``: ``hermes`` (``<tool_call>{"name": .., "arguments": ..}</tool_call>``, the
  format of Qwen 2.5/3, Hermes and the ChatML tool template bundled here) or ``llama3_json``
  (``{"name": .., "parameters": ..}`` objects, ``;``-separated, optionally after ``<|python_tag|>``).
  Text outside the calls is the message content; a call that does not parse stays content.

Streaming: ``ToolStream.feed`` turns each text delta into a content delta and tool-call deltas in
OpenAI's shape (a call's first delta has its index, id, type and name; argument text follows);
the non-streamed reply is the same stream fed at once, so both agree.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from prefixkv.server.protocol import FunctionDelta, ProtocolError, ToolCallDelta

PARSERS = ("hermes", "llama3_json")
AUTO = "auto"  # --tool-call-parser auto: the parser the chat template's tool format calls for
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_DROPPED = object()  # a well-formed call beyond the first with parallel_tool_calls false


@dataclass
class ToolPlan:
    """What a request's tools mean for its reply (see the module docstring)."""

    mode: str  # "none" | "named" | "required" | "auto"
    tools: list[dict]  # OpenAI tool dicts, as rendered into the template
    parser: str | None = None  # for "auto"
    parallel: bool = True  # parallel_tool_calls: false keeps an "auto" reply's first call only
    function: str | None = None  # for "named"
    structured_outputs: dict | None = None  # the constraint for "named" / "required"
    aliases: dict[str, str] = field(default_factory=dict)  # engine field -> the request field to name

    @property
    def calls_finish_reason(self) -> str:
        return "stop" if self.mode == "named" else "tool_calls"

    def stream(self) -> "ToolStream":
        return ToolStream(self)


def plan_tools(tools: list[dict] | None, tool_choice: Any, parallel_tool_calls: bool | None,
               parser: str | None) -> ToolPlan | None:
    """Validate ``tools`` / ``tool_choice`` (ProtocolError naming the field) and plan the reply."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ProtocolError("tool_choice: is only allowed when tools are given", "tool_choice")
        return None
    names: dict[str, int] = {}
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if t.get("type") != "function":
            raise ProtocolError(f"{where}.type: must be 'function', got {t.get('type')!r:.40}", f"{where}.type")
        fn = t.get("function") or {}
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ProtocolError(f"{where}.function.name: must be 1-64 letters, digits, '_' or '-', got {name!r:.70}",
                                f"{where}.function.name")
        if name in names:
            raise ProtocolError(f"{where}.function.name: {name!r} is given twice", f"{where}.function.name")
        names[name] = i
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ProtocolError(f"{where}.function.parameters: must be a JSON schema object",
                                f"{where}.function.parameters")
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance((choice.get("function") or {}).get("name"), str):
            raise ProtocolError("tool_choice: must be 'none', 'auto', 'required' or "
                                "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
        name = choice["function"]["name"]
        if name not in names:
            raise ProtocolError(f"tool_choice.function.name: {name!r} is not among the tools "
                                f"({', '.join(names)})", "tool_choice.function.name")
        i = names[name]
        return ToolPlan("named", tools, function=name, structured_outputs={"json": _parameters(tools[i])},
                        aliases={"structured_outputs.json": f"tools[{i}].function.parameters"})
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                   "parameters": _parameters(t)},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
        schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan("required", tools, structured_outputs={"json": schema},
                        aliases={"structured_outputs.json": "tools"})
    if choice == "auto":
        if parser is None:
            raise ProtocolError("tool_choice: 'auto' needs the server started with --tool-call-parser "
                                f"({' or '.join(PARSERS)}); 'required', 'none' or a named function work without",
                                "tool_choice")
        return ToolPlan("auto", tools, parser=parser, parallel=parallel_tool_calls is not False)
    raise ProtocolError(f"tool_choice: must be 'none', 'auto', 'required' or a named function, got {choice!r:.40}",
                        "tool_choice")


def detect_tool_parser(chat_template: str) -> tuple[str | None, str]:
    """The parser for the tool calls this chat template teaches (``--tool-call-parser auto``), and
    why: ``<tool_call>`` (Qwen 2.5/3, Hermes) -> hermes; Llama 3.1+'s ``<|python_tag|>`` or its JSON
    call instructions -> llama3_json; a ChatML template that renders no tools (SmolLM2's) gets the
    bundled Hermes template for tool requests (tokenizer.py) -> hermes; anything else: none."""
    if _HERMES_OPEN in chat_template:
        return "hermes", "the chat template writes <tool_call>"
    if _PYTHON_TAG in chat_template or ("<|eot_id|>" in chat_template and '"parameters"' in chat_template):
        return "llama3_json", "the chat template is Llama 3's with JSON tool calls"
    if "<|im_start|>" in chat_template and "tool" not in chat_template:
        return "hermes", "a ChatML template without tools: tool requests use the bundled Hermes template"
    return None, "no tool-call format recognised in the chat template"


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


class ToolStream:
    """One choice's reply, fed as text deltas: ``feed`` returns (content delta, tool-call deltas);
    ``close`` at the end returns what was held back. ``calls`` and ``content`` hold the result."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.calls: list[ToolCall] = []
        self.content_parts: list[str] = []
        self._buf = ""  # text not yet turned into content or calls
        self._inside = False  # hermes: within <tool_call> ... </tool_call>
        self._json_mode: bool | None = None  # llama3_json: the reply is calls (decided by its first char)
        self._scan = _ArrayScanner()  # required

    @property
    def content(self) -> str | None:
        text = "".join(self.content_parts)
        return text if text or not self.calls else None

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        mode = self.plan.mode
        if mode == "named":  # the whole reply is the call's arguments
            deltas = []
            if not self.calls:
                call = ToolCall(new_call_id(), self.plan.function, "")
                self.calls.append(call)
                deltas.append(_start_delta(0, call, ""))
            if text:
                self.calls[0].arguments += text
                deltas.append(ToolCallDelta(0, function=FunctionDelta(arguments=text)))
            return "", deltas
        if mode == "required":
            return "", [self._add(name, args) for name, args in self._scan.feed(text)]
        if mode == "auto" and self.plan.parser == "hermes":
            return self._hermes(text, final=False)
        if mode == "auto" and self.plan.parser == "llama3_json":
            return self._llama3(text, final=False)
        return self._content(text), []

    def close(self) -> tuple[str, list[ToolCallDelta]]:
        if self.plan.mode == "auto" and self.plan.parser == "hermes":
            return self._hermes("", final=True)
        if self.plan.mode == "auto" and self.plan.parser == "llama3_json":
            return self._llama3("", final=True)
        return "", []

    # ------------------------------------------------------------------ parsing pieces
    def _content(self, text: str) -> str:
        if text:
            self.content_parts.append(text)
        return text

    def _add(self, name: str, arguments: Any) -> ToolCallDelta:
        call = ToolCall(new_call_id(), name, arguments if isinstance(arguments, str) else json.dumps(arguments))
        self.calls.append(call)
        return _start_delta(len(self.calls) - 1, call, call.arguments)

    def _parse_call(self, text: str, args_key: str) -> ToolCallDelta | object | None:
        try:
            obj = json.loads(text)
        except ValueError:
            return None
        names = {t["function"]["name"] for t in self.plan.tools}
        if not isinstance(obj, dict) or obj.get("name") not in names:
            return None
        if not self.plan.parallel and self.calls:
            return _DROPPED
        args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
        return self._add(obj["name"], args if args is not None else {})

    def _hermes(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        self._buf += text
        content, deltas = [], []

        def text_piece(piece: str) -> None:  # whitespace between and after calls is not content
            if piece and (piece.strip() or not self.calls):
                content.append(piece)

        while True:
            if not self._inside:
                i = self._buf.find(_HERMES_OPEN)
                if i < 0:
                    keep = 0 if final else partial_suffix(self._buf, _HERMES_OPEN)
                    if keep or final or self._buf.strip() or not self.calls:  # (whitespace may precede a call)
                        text_piece(self._buf[:len(self._buf) - keep])
                        self._buf = self._buf[len(self._buf) - keep:]
                    break
                text_piece(self._buf[:i])
                self._buf, self._inside = self._buf[i + len(_HERMES_OPEN):], True
            j = self._buf.find(_HERMES_CLOSE)
            if j < 0:
                if final:  # an unclosed call: it stays text
                    content.append(_HERMES_OPEN + self._buf)
                    self._buf = ""
                break
            delta = self._parse_call(self._buf[:j].strip(), "arguments")
            if delta is None:  # not a call of these tools: text
                content.append(_HERMES_OPEN + self._buf[:j + len(_HERMES_CLOSE)])
            elif delta is not _DROPPED:
                deltas.append(delta)
            self._buf, self._inside = self._buf[j + len(_HERMES_CLOSE):], False
        return self._content("".join(content)), deltas

    def _llama3(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        if self._json_mode is False:
            return self._content(text), []
        self._buf += text
        head = self._buf.lstrip()
        if self._json_mode is None:
            if not head or (_PYTHON_TAG.startswith(head) and not final):
                return "", []
            self._json_mode = head.startswith(("{", _PYTHON_TAG))
            if not self._json_mode:
                out, self._buf = self._buf, ""
                return self._content(out), []
        if not final:
            return "", []  # calls are parsed once the reply is complete
        body = head[len(_PYTHON_TAG):] if head.startswith(_PYTHON_TAG) else head
        deltas = []
        for part in _split_objects(body):
            d = self._parse_call(part, "parameters")
            if d is None:  # not all calls: the reply is text
                self.calls.clear()
                out, self._buf = self._buf, ""
                return self._content(out), []
            if d is not _DROPPED:
                deltas.append(d)
        self._buf = ""
        return "", deltas


def _start_delta(index: int, call: ToolCall, arguments: str) -> ToolCallDelta:
    return ToolCallDelta(index, id=call.id, type="function", function=FunctionDelta(name=call.name, arguments=arguments))


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that begins ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _split_objects(text: str) -> list[str]:
    """Top-level JSON objects in ``text`` separated by ';' or whitespace."""
    parts, scanner = [], _ObjectScanner()
    for obj in scanner.feed(text):
        parts.append(obj)
    rest = scanner.pending.strip().strip(";").strip()
    if rest or not parts:
        parts.append(rest or text)
    return parts


class _ObjectScanner:
    """Finds complete top-level JSON objects in text fed in pieces (string- and escape-aware)."""

    def __init__(self) -> None:
        self.pending = ""
        self._depth = 0
        self._in_str = False
        self._esc = False
        self._start = -1

    def feed(self, text: str) -> list[str]:
        out = []
        base = len(self.pending)
        self.pending += text
        for k, ch in enumerate(text, start=base):
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif ch == "\\":
                    self._esc = True
                elif ch == '"':
                    self._in_str = False
            elif ch == '"':
                self._in_str = True
            elif ch == "{":
                if self._depth == 0:
                    self._start = k
                self._depth += 1
            elif ch == "}" and self._depth > 0:
                self._depth -= 1
                if self._depth == 0:
                    out.append(self.pending[self._start:k + 1])
                    self._start = -1
        if self._depth == 0:  # drop what is consumed
            last = self.pending.rfind("}") + 1 if out else 0
            self.pending = self.pending[last:]
        return out


class _ArrayScanner:
    """The items of a streamed JSON array of ``{"name": .., "parameters": ..}`` objects (the
    grammar guarantees the shape), each returned once it is complete."""

    def __init__(self) -> None:
        self._objects = _ObjectScanner()
        self._started = False

    def feed(self, text: str) -> list[tuple[str, Any]]:
        if not self._started:
            i = text.find("[")
            if i < 0:
                return []
            self._started, text = True, text[i + 1:]
        out = []
        for obj in self._objects.feed(text):
            item = json.loads(obj)
            out.append((item["name"], item["parameters"]))
        return out
