"""The messages between the front-end processes and the engine-core process: msgspec Structs,
MessagePack on a ZMQ DEALER (each client) <-> ROUTER (the core) socket.

Client -> core::

    Hello                                       once per connection: the core may now send to it
    AddRequests(call_id, requests, params)      answered by Reply(call_id): accepted, or the error
    Abort(request_ids)                          no answer; unknown ids are ignored
    Call(call_id, method, args)                 a named utility (``core.UTILITIES``): Reply(call_id)
    Shutdown                                    the owning client only: abort all, flush the KV tiers, exit 0

Core -> client::

    Reply(call_id, result | error_kind + error)
    StepOutputs(outputs, stats)                 one per step per client: the token deltas of its
                                                requests that moved, the engine statistics when due
    Dead(message)                               the engine died (EngineFatalError): the core exits 1
    Refused(message)                            a message the core could not decode and answer

Outputs carry token ids only: the engine core runs requests with ``detokenize=False`` and no stop
strings; the client detokenizes, applies stop strings and builds ``RequestOutput``s
(engine_core/client.py). Logprobs are float64 on the wire (exact).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

import msgspec

from prefixkv.outputs import TokenLogprob
from prefixkv.sampling_params import SamplingParams


class Hello(msgspec.Struct, tag="hello", array_like=True):
    pass


class AddRequests(msgspec.Struct, tag="add", array_like=True):
    call_id: int
    requests: list[tuple[str, list[int]]]  # (request id, prompt token ids); all or none are queued
    params: dict[str, Any]  # the engine core's SamplingParams (``core_params``) as ``params_to_wire``


class Abort(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class Call(msgspec.Struct, tag="call", array_like=True):
    call_id: int
    method: str
    args: list[Any] = []


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


ClientMessage = Union[Hello, AddRequests, Abort, Call, Shutdown]


class SeqDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """One sample's new tokens in a step (and its finish, once it has one)."""

    index: int
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id that ended it
    logprobs: list[TokenLogprob] | None = None  # one per new token when the request asked for them


class CoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    seqs: list[SeqDelta]
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None  # the step failed for this request: "ExceptionType: message"
    prompt_logprobs: list[TokenLogprob] | None = None  # once, when the whole prompt is computed


class Reply(msgspec.Struct, tag="reply", array_like=True, omit_defaults=True):
    call_id: int
    result: Any = None
    error_kind: str | None = None  # ERROR_KINDS' names; None: success
    error: str | None = None


class StepOutputs(msgspec.Struct, tag="out", array_like=True, omit_defaults=True):
    outputs: list[CoreOutput]
    stats: dict[str, int | float] | None = None


class Dead(msgspec.Struct, tag="dead", array_like=True):
    message: str


class Refused(msgspec.Struct, tag="refused", array_like=True):
    message: str


CoreMessage = Union[Reply, StepOutputs, Dead, Refused]


# exception class -> the error kind a Reply names (checked in order: subclasses first); the client
# raises the same class
ERROR_KINDS: tuple[tuple[type[BaseException], str], ...] = (
    (ValueError, "invalid"),
    (OverflowError, "overloaded"),
)


def error_kind(e: BaseException) -> str:
    return next((kind for cls, kind in ERROR_KINDS if isinstance(e, cls)), "failed")


_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.init)


def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    """The fields that differ from their defaults (``SamplingParams(**wire)`` rebuilds it)."""
    defaults = _DEFAULT_PARAMS
    out = {}
    for name in _PARAM_FIELDS:
        value = getattr(params, name)
        if value != getattr(defaults, name):
            out[name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    return out


def params_from_wire(wire: dict[str, Any]) -> SamplingParams:
    """``SamplingParams(**wire)``; int keys of ``logit_bias`` survive MessagePack as ints."""
    return SamplingParams(**wire)


def core_params(params: SamplingParams) -> SamplingParams:
    """What the engine core runs for ``params``: token ids only (no text, no stop strings: the
    client applies them), one delta per step."""
    return dataclasses.replace(params, stop=[], detokenize=False, output_kind="delta",
                               include_stop_str_in_output=False)


_DEFAULT_PARAMS = SamplingParams()
CLIENT_ENCODER = msgspec.msgpack.Encoder()
CLIENT_DECODER = msgspec.msgpack.Decoder(ClientMessage)
CORE_ENCODER = msgspec.msgpack.Encoder()
CORE_DECODER = msgspec.msgpack.Decoder(CoreMessage)
