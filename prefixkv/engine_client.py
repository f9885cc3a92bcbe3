"""What a front end needs of an engine: ``EngineClient`` and the ``OutputStream`` of one request.

The API layers (``server/serving.py``'s OpenAI layer, and any layer built beside it) talk to an
engine only through this surface, so one layer serves every way of running the engine:

===========================================  ===========================================================
``AsyncEngine`` (prefixkv/async_engine.py)    the engine stepped by a thread of this process (``LLM``,
                                              tests, notebooks)
``EngineCoreClient`` (engine_core/client.py)  the engine stepped in its own process, messages over ZMQ
                                              (``prefixkv serve``, the Ray replicas)
``RemoteEngine`` (serve/ingress.py)           requests routed to Ray Serve engine replicas
===========================================  ===========================================================

Contract of ``add_requests``: every prompt is validated before any is queued; an error raises
``ValueError`` (naming the field: a 400), ``OverflowError`` (the waiting queue is full: a 503) or
``EngineDeadError`` (the engine is shut down or dead), and then nothing stays queued. On success the
requests enter the engine together and each gets an ``OutputStream``. A stream yields ``RequestOutput``
deltas (``SamplingParams.output_kind``; the OpenAI layer asks for "delta") until one with
``finished``; a consumer slower than the engine gets several steps' deltas merged into one. Leaving
a stream early -- ``abort()``, or dropping it -- aborts the request, which frees its KV blocks; an
engine failure reaches the consumer as an exception from ``__anext__``: ``RequestFailedError`` (a
step failed for this request alone), ``RequestAbortedError``, ``EngineDeadError`` (shutdown), its
subclass ``EngineFatalError`` (the engine died: ``fatal_error`` is set, ``is_running`` False, and a
server exits non-zero), or ``ReplicaDiedError``.

An engine whose prefix cache can be controlled offers ``CacheControl`` (``AsyncEngine``,
``EngineCoreClient``, and ``RemoteEngine``, which spreads requests over replicas with a cache each
and asks every replica to release or to reset: serve/control_log.py). The API layers test for it
(``isinstance``) and do without where it is missing.

No torch, no server library here: the Protocols are structural (``typing.Protocol``), so the
engines need not import this module to satisfy it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from prefixkv.config import RuntimeInfo
    from prefixkv.outputs import RequestOutput
    from prefixkv.sampling_params import SamplingParams
    from prefixkv.tokenizer import Tokenizer

PromptType = str | Sequence[int]


@runtime_checkable
class OutputStream(Protocol):
    """One request's outputs (see the module docstring). ``abort`` never raises and is safe from
    any thread; after it (or after the finished output) ``done`` is True."""

    request_id: str

    @property
    def done(self) -> bool: ...

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    async def __anext__(self) -> RequestOutput: ...

    def abort(self) -> None: ...


@runtime_checkable
class EngineClient(Protocol):
    """An engine as the API layers see it (see the module docstring for the contract).

    - ``tokenizer``: the model's tokenizer, for chat templates, prompts and token texts (it runs in
      the caller's process: the engine gets token ids).
    - ``info``: ``RuntimeInfo`` (max_model_len, vocab_size, eos_token_ids, num_kv_blocks).
    - ``max_waiting_requests``: the engine's queue bound (a batch of prompts larger is a 400).
    - ``default_sampling``: the model's generation_config.json defaults, for the fields a request
      leaves unset.
    - ``compile_grammar``: validates (and may cache) a request's structured outputs: ``ValueError``
      naming the field. It may block: call it off the event loop.
    - ``stats()``: the engine's statistics (``LLMEngine.stats()``'s keys) as last published; no
      engine call, cheap enough for every /metrics scrape.
    - ``cache_summary``: ``LLMEngine.cache_summary(max_nodes, text_tokens)``, computed between steps.
    - ``is_running`` / ``fatal_error``: what /health answers and whether a server must exit.
    - ``start``: called by a server on its event loop once, before the first request (an engine
      that talks over a socket opens it there and starts watching the engine's process).
    - ``shutdown``: in-flight requests end with ``EngineDeadError``; waits for the engine to stop.
    """

    tokenizer: Tokenizer
    info: RuntimeInfo
    max_waiting_requests: int
    default_sampling: dict[str, Any]
    fatal_error: BaseException | None

    @property
    def is_running(self) -> bool: ...

    def compile_grammar(self, structured_outputs: Any) -> None: ...

    async def add_requests(self, requests: list[tuple[str, PromptType]],
                           params: SamplingParams) -> Sequence[OutputStream]: ...

    def stats(self) -> dict[str, Any]: ...

    async def cache_summary(self, max_nodes: int, text_tokens: int = 0) -> dict[str, Any]: ...

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...


@runtime_checkable
class CacheControl(Protocol):
    """What a server may ask of the engine's prefix cache besides requests (each runs between two
    steps; the Ray ingress's engine asks every replica through the control log,
    serve/control_log.py):

    - ``release_retention(handle)``: ``LLMEngine.release_retention`` (a deleted stored Response's
      retention lets go before its TTL); False if ``handle`` holds none. Through the Ray ingress:
      logged for every replica to release within a routing-stats period; True once logged.
    - ``reset_prefix_cache()``: ``LLMEngine.reset_prefix_cache`` (every tier; ``AllBlocksCleared``
      with KV events on); False, nothing changed, while a request runs or waits (through the Ray
      ingress: False if one replica refused).
    """

    async def release_retention(self, handle: str) -> bool: ...

    async def reset_prefix_cache(self) -> bool: ...
