"""Reasoning split out of a reply (``--reasoning-parser``): models that think before they answer
write ``<think> ... </think>`` (Qwen3, QwQ, DeepSeek-R1 and its distillations). The text before
``</think>`` is the reasoning, the text after it the answer; each API shows the reasoning its own way:
``reasoning_content`` on chat messages and deltas, a ``reasoning`` output item in Responses, a
``thinking`` block in Anthropic Messages.

Both parsers read the reply as vLLM's do: it starts in the reasoning (the chat template may have put
``<think>`` in the prompt; a ``<think>`` the model writes itself is dropped) and a reply that never
closes it is all reasoning (it was cut by max_tokens). ``qwen3`` honours the template switch
``enable_thinking: false`` (``chat_template_kwargs``; Anthropic's ``thinking: {"type": "disabled"}``):
the reply is then all answer. Whitespace between ``</think>`` and the answer is not part of either.

``ReasoningStream.feed`` takes the reply's text deltas and returns (reasoning, answer) deltas,
holding back only a tail that could be the start of a tag; the whole reply fed at once splits the
same way (streamed and non-streamed replies agree).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefixkv.server.protocol import ToolCallDelta
from prefixkv.server.tools import ToolCall, ToolPlan, partial_suffix

REASONING_PARSERS = ("deepseek_r1", "qwen3")
_OPEN, _CLOSE = "<think>", "</think>"


def thinking_enabled(parser: str | None, template_kwargs: dict | None, constraint: Any = None) -> bool:
    """Whether replies to this request are split: not when ``enable_thinking: false`` turns qwen3's
    off, nor when the reply is held to JSON (``constraint``, its StructuredOutputsParams: a schema,
    json_object or a forced tool call), which holds no ``<think>``."""
    if parser is None or constraint is not None and (constraint.json is not None or constraint.json_object):
        return False
    return not (parser == "qwen3" and (template_kwargs or {}).get("enable_thinking") is False)


@dataclass
class ReasoningStream:
    """One reply's split into reasoning and answer (see the module docstring)."""

    reasoning: list[str] = field(default_factory=list)
    answer: list[str] = field(default_factory=list)
    _buf: str = ""
    _state: str = "start"  # "start" (a <think> may come) | "reasoning" | "after" (whitespace dropped) | "answer"

    @property
    def reasoning_text(self) -> str | None:
        return "".join(self.reasoning) or None

    def feed(self, text: str) -> tuple[str, str]:
        return self._step(text, final=False)

    def close(self) -> tuple[str, str]:
        return self._step("", final=True)

    def _step(self, text: str, final: bool) -> tuple[str, str]:
        buf = self._buf + text
        r, a = "", ""
        if self._state == "start":
            head = buf.lstrip()
            if head.startswith(_OPEN):
                buf, self._state = head[len(_OPEN):], "reasoning"
            elif final or not _OPEN.startswith(head):
                self._state = "reasoning"
            else:  # (whitespace or the start of "<think>" so far)
                self._buf = buf
                return "", ""
        if self._state == "reasoning":
            i = buf.find(_CLOSE)
            if i < 0:
                keep = 0 if final else partial_suffix(buf, _CLOSE)
                r, buf = buf[:len(buf) - keep], buf[len(buf) - keep:]
            else:
                r, buf, self._state = buf[:i], buf[i + len(_CLOSE):], "after"
        if self._state == "after":
            buf = buf.lstrip()
            if buf:
                self._state = "answer"
        if self._state == "answer":
            a, buf = buf, ""
        self._buf = buf
        if r:
            self.reasoning.append(r)
        if a:
            self.answer.append(a)
        return r, a



class ReplyParser:
    """One reply's text deltas -> (reasoning, content, tool-call deltas): the reasoning split first
    (when ``reasoning``), then the answer through the request's tool plan (when it has one). Every
    API builds its reply from this, whole or streamed."""

    def __init__(self, tools: ToolPlan | None, reasoning: bool) -> None:
        self._tools = tools.stream() if tools is not None and tools.mode != "none" else None
        self._reasoning = ReasoningStream() if reasoning else None
        self._content: list[str] = []

    @property
    def calls(self) -> list[ToolCall]:
        return self._tools.calls if self._tools is not None else []

    @property
    def reasoning(self) -> str | None:
        return self._reasoning.reasoning_text if self._reasoning is not None else None

    @property
    def content(self) -> str | None:
        """The answer's text; None when the reply is only tool calls or only reasoning."""
        text = "".join(self._content)
        return text if text or not (self.calls or self.reasoning) else None

    def feed(self, text: str) -> tuple[str, str, list[ToolCallDelta]]:
        return self._step(text, final=False)

    def close(self) -> tuple[str, str, list[ToolCallDelta]]:
        return self._step("", final=True)

    def _step(self, text: str, final: bool) -> tuple[str, str, list[ToolCallDelta]]:
        reasoning = ""
        if self._reasoning is not None:
            reasoning, text = self._reasoning.close() if final else self._reasoning.feed(text)
            if final and text:  # (what close() released goes through the tools below, then they close)
                content, calls = self._tool_step(text, final=False)
                more, more_calls = self._tool_step("", final=True)
                return reasoning, content + more, calls + more_calls
        content, calls = self._tool_step(text, final)
        return reasoning, content, calls

    def _tool_step(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        if self._tools is None:
            if text:
                self._content.append(text)
            return text, []
        content, calls = self._tools.close() if final else self._tools.feed(text)
        if content:
            self._content.append(content)
        return content, calls
