"""The OpenAI wire format as msgspec Structs.

Requests are decoded and type-checked in one pass; a field the server does not know is refused
(400 naming it), and fields of the OpenAI / vLLM surface it does not implement are declared so that
the refusal says so (``UNSUPPORTED_FIELDS``): nothing a client sends is silently ignored.
``decode_request`` turns msgspec's errors into ``ProtocolError(message, param)`` where
``param`` is the field path ("messages[0].role"). Responses and stream chunks are Structs encoded
straight to JSON. Logprobs are converted from the engine's ``TokenLogprob`` list into the chat format
(``content: [{token, logprob, bytes, top_logprobs}]``) and the legacy completions format
(``tokens, token_logprobs, top_logprobs, text_offset``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Struct

from prefixkv.outputs import TokenLogprob

# token id -> (text, utf-8 bytes) of that token alone
TokenText = Callable[[int], tuple[str, bytes]]
S = TypeVar("S")


class ProtocolError(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


# ---------------------------------------------------------------------- requests
class StreamOptions(Struct):
    include_usage: bool = False


class ContentPart(Struct, omit_defaults=True):
    type: str
    text: str | None = None


class FunctionCallIn(Struct, forbid_unknown_fields=True):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallIn(Struct, kw_only=True, forbid_unknown_fields=True):
    id: str
    function: FunctionCallIn
    type: str = "function"


class ChatMessage(Struct, omit_defaults=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a "tool" message: the call it answers


class FunctionDef(Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema
    strict: bool | None = None  # the schema is enforced exactly whenever it is enforced (required / named)


class ToolDef(Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    function: FunctionDef


class NamedFunction(Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    function: NamedFunction


class JsonSchemaFormat(Struct, kw_only=True, forbid_unknown_fields=True):
    name: str | None = None
    description: str | None = None
    schema: dict | bool | None = None
    strict: bool | None = None  # the schema is always enforced exactly (a token mask), strict or not


class ResponseFormat(Struct, kw_only=True, forbid_unknown_fields=True):
    type: str  # "text", "json_object" or "json_schema"
    json_schema: JsonSchemaFormat | None = None


# Fields of the OpenAI / vLLM request surface this server does not implement: a non-null value is a
# 400 naming the field (null means absent).
UNSUPPORTED_FIELDS = ("functions", "function_call", "guided_json",
                      "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend", "best_of", "use_beam_search",
                      "length_penalty", "truncate_prompt_tokens", "metadata", "store", "service_tier",
                      "modalities", "audio", "prediction", "reasoning_effort", "web_search_options")


class ApiRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    """The base of every generation request (chat, completions, responses, messages): a field they
    all share is declared here once and read where every request reaches the engine,
    ``OpenAIServing.add_requests``.

    ``cache_salt`` (vLLM's): requests share prefix-cache blocks only with requests of the same salt
    (and, with ``--cache-isolation api-key``, of the same API key); a non-empty string."""

    cache_salt: Annotated[str, msgspec.Meta(min_length=1)] | None = None


# declared (as Any, default None) only to be refused by name
_Unsupported = msgspec.defstruct("_Unsupported", [(f, Any, None) for f in UNSUPPORTED_FIELDS], kw_only=True,
                                 forbid_unknown_fields=True, bases=(ApiRequest,))


class KvRetention(Struct, kw_only=True, forbid_unknown_fields=True):
    """``kv_retention`` (an extension, on chat and completions): keep the prompt's first
    ``num_tokens`` tokens (default: the whole prompt) in the prefix cache for ``ttl_s`` seconds
    since their last use (README "Retention"; ``SamplingParams.kv_retention_ttl_s``)."""

    ttl_s: float
    num_tokens: int | None = None


class _SamplingRequest(_Unsupported, kw_only=True, forbid_unknown_fields=True):
    """Fields shared by both endpoints. None (absent or null) means the default: SamplingParams' own."""

    model: str | None = None  # optional (the served model); any other name is rejected
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stream_interval: int | None = None  # vLLM's: a chunk every this many tokens (the server's --stream-interval at least)
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None
    user: str | None = None  # an end-user id for abuse tracking (OpenAI): nothing to do with the output
    response_format: ResponseFormat | None = None
    structured_outputs: dict | None = None  # vLLM's: json / json_object / regex / choice / grammar
    logit_bias: dict[str, float] | None = None  # token id (a JSON object's keys are strings) -> bias
    allowed_token_ids: list[int] | None = None  # vLLM's
    include_stop_str_in_output: bool | None = None  # vLLM's
    bad_words: list[str] | None = None  # vLLM's
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' logprobs, with this many top ones
    kv_retention: KvRetention | None = None

    def unsupported_field(self) -> str | None:
        """The first declared-but-unsupported field the request sets (non-null), if any."""
        return next((f for f in UNSUPPORTED_FIELDS if getattr(self, f) is not None), None)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_SamplingRequest, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # the newer name of max_tokens; wins when both are set
    logprobs: bool | None = None
    top_logprobs: int | None = None
    chat_template_kwargs: dict | None = None  # extra variables for the chat template (vLLM's)
    tools: list[ToolDef] | None = None  # server/tools.py
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_SamplingRequest, kw_only=True):
    # a string, a list of token ids, or a list of either (a batch of prompts)
    prompt: str | list[str | int | list[int]]
    max_tokens: int | None = 16  # OpenAI's default for /v1/completions
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None


class TokenizeRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's /tokenize: a ``prompt`` or chat ``messages`` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # for ``prompt``
    add_generation_prompt: bool = True  # for ``messages``
    return_token_strs: bool = False


class DetokenizeRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[int]


_AT = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_MISSING = re.compile(r"missing required field `(?P<field>[^`]+)`")
_UNKNOWN = re.compile(r"unknown field `(?P<field>[^`]+)`")


def decode_request(body: bytes, type: type[S]) -> S:
    """JSON body -> request Struct; ``ProtocolError`` (with the field path as param) if it is
    malformed or has a wrong type."""
    if not body.strip():
        raise ProtocolError("the request body is empty; expected a JSON object")
    try:
        return msgspec.json.decode(body, type=type)
    except msgspec.ValidationError as e:
        raise _validation_error(e, "") from None
    except msgspec.DecodeError as e:
        raise ProtocolError(f"malformed JSON body: {e}") from None
    except RecursionError:
        raise ProtocolError("malformed JSON body: nested too deeply") from None


def convert(obj: Any, type: type[S], path: str) -> S:
    """A decoded JSON value (a dict) -> ``type``, errors naming the field under ``path`` (an item
    whose type is read from its own "type" field, e.g. ``input[2]``)."""
    try:
        return msgspec.convert(obj, type)
    except msgspec.ValidationError as e:
        raise _validation_error(e, path) from None


def _validation_error(e: msgspec.ValidationError, prefix: str) -> ProtocolError:
    msg = str(e)
    m = _AT.search(msg)
    path = m.group("path") if m else ""
    missing = _MISSING.search(msg)
    if missing:
        path = f"{path}.{missing.group('field')}" if path else missing.group("field")
    unknown = _UNKNOWN.search(msg)
    if unknown:
        path = f"{path}.{unknown.group('field')}" if path else unknown.group("field")
    if prefix:
        path = f"{prefix}{path if path.startswith('[') or not path else '.' + path}"
    if unknown:
        return ProtocolError(f"{path}: unknown field (this server refuses fields it does not know rather "
                             f"than ignore them)", path)
    if m:  # (the message's own "- at `$...`" is the path, now in front)
        msg = msg[:m.start()]
    return ProtocolError(f"{path}: {msg}" if path else f"request body: {msg}", path or None)


def prompt_list(prompt: str | list) -> list[str | list[int]]:
    """A completions ``prompt`` as a list of prompts (each a str or a token-id list)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ProtocolError("prompt: must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [prompt]
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        return list(prompt)
    raise ProtocolError("prompt: must be a string, a list of token ids, or a list of strings or of "
                        "token-id lists (not a mix)", "prompt")


# ---------------------------------------------------------------------- errors
class ErrorBody(Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Struct):
    error: ErrorBody


# ---------------------------------------------------------------------- responses
class PromptTokensDetails(Struct):
    cached_tokens: int = 0


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def make_usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> Usage:
    return Usage(num_prompt_tokens, num_completion_tokens, num_prompt_tokens + num_completion_tokens,
                 PromptTokensDetails(num_cached_tokens))


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[ChatTokenLogprob] | None


class FunctionCall(Struct):
    name: str
    arguments: str  # JSON text


class ToolCallOut(Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class ChatMessageOut(Struct, omit_defaults=True):
    role: str
    content: str | None  # null when the reply is tool calls only
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = None  # --reasoning-parser: the reply's reasoning (vLLM's field)


class ChatChoice(Struct):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it


class PromptLogprob(Struct):
    """vLLM's: one entry of ``prompt_logprobs`` (keyed by token id)."""

    logprob: float
    rank: int | None
    decoded_token: str | None


# vLLM's prompt_logprobs: null for the first prompt token, then {token id: PromptLogprob} per token
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class ChatCompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    prompt_logprobs: PromptLogprobs | None = None


class FunctionDelta(Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(Struct, omit_defaults=True):
    """One piece of a streamed tool call: the first has id, type and name; arguments follow."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionDelta | None = None


class DeltaMessage(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning_content: str | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token (nothing precedes it)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TokenizeResponse(Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(Struct):
    prompt: str


class VersionResponse(Struct):
    version: str


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's (non-streamed responses)


class CompletionResponse(Struct):
    """Also the stream chunk of /v1/completions (OpenAI uses the same object for both)."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"


class ModelCard(Struct):
    id: str
    created: int
    owned_by: str = "prefixkv"
    max_model_len: int | None = None
    object: str = "model"


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


# ---------------------------------------------------------------------- logprobs
def chat_logprobs(lps: list[TokenLogprob], token_text: TokenText, num_top: int) -> ChatLogprobs:
    content = []
    for lp in lps:
        text, raw = token_text(lp.token_id)
        tops = [_top(token_text, tid, v) for tid, v in lp.top_logprobs[:num_top]]
        content.append(ChatTokenLogprob(text, lp.logprob, list(raw), tops))
    return ChatLogprobs(content)


def _top(token_text: TokenText, token_id: int, logprob: float) -> TopLogprob:
    text, raw = token_text(token_id)
    return TopLogprob(text, logprob, list(raw))


def completion_logprobs(lps: list[TokenLogprob], token_text: TokenText, num_top: int,
                        text_offset: int = 0) -> CompletionLogprobs:
    """``text_offset`` is where the first of these tokens starts in the choice's text (streaming
    passes the length already sent)."""
    return _add_completion_logprobs(CompletionLogprobs([], [], [], []), lps, token_text, num_top, text_offset)


def echo_logprobs(prompt_ids: list[int], lps: list[TokenLogprob], token_text: TokenText,
                  num_top: int) -> CompletionLogprobs:
    """An echoed prompt's tokens in the completions format: the first has no logprob (null, as
    OpenAI and vLLM answer), token i + 1's record is ``lps[i]``."""
    first, _ = token_text(prompt_ids[0])
    out = CompletionLogprobs([first], [None], [None], [0])
    return _add_completion_logprobs(out, lps, token_text, num_top, len(first))


def _add_completion_logprobs(out: CompletionLogprobs, lps: list[TokenLogprob], token_text: TokenText,
                             num_top: int, text_offset: int) -> CompletionLogprobs:
    offset = text_offset
    for lp in lps:
        text, _ = token_text(lp.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(lp.logprob)
        top: dict[str, float] = {}
        for tid, v in lp.top_logprobs[:num_top]:  # most likely first; tokens with the same text collide
            top.setdefault(token_text(tid)[0], v)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out


_encoder = msgspec.json.Encoder()


def encode(obj: object) -> bytes:
    return _encoder.encode(obj)


def prompt_logprobs_wire(plps: list | None) -> PromptLogprobs | None:
    """``RequestOutput.prompt_logprobs`` (vLLM's offline shape) -> the wire's."""
    if plps is None:
        return None
    return [None if e is None else {str(t): PromptLogprob(lp.logprob, lp.rank, lp.decoded_token) for t, lp in e.items()}
            for e in plps]
