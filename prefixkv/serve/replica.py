"""One engine replica of a Ray Serve application: an engine with its own KV pool, taking token ids
from the ingress and streaming ``RequestOutput`` deltas back.

The engine steps in its own process, as under ``prefixkv serve`` (an ``EngineCoreClient``; the
core is a child of the replica's actor and ends with it): the actor's own Python -- Serve's
request handling, pickling each output for the ingress, this class, detokenization -- then never
holds up a step. ``engine_process=False`` keeps it in a thread of the actor (``AsyncEngine``).

Streams start with a verdict, so that the ingress can answer 400 / 503 before it sends a 200::

    ("accepted", replica_id) | ("error", kind, message)     then RequestOutput ... (last: finished)
                                                            or a final ("error", kind, message)

``kind`` is one of ``ERROR_KINDS``; the ingress raises the matching exception (serve/ingress.py).
Cancelling the stream (the client went away) aborts the request here, which frees its blocks.

Every ``request_routing_stats_period_s`` Serve's controller calls ``record_routing_stats``: the
replica first does what the ingress logged since (serve/control_log.py: the retentions of deleted
stored Responses to release, prefix-cache resets to do and report), then answers with its cache
digest (``KVCacheCoordinator.routing_digest``: block hash -> tier of every cached block), its engine
statistics and a bounded summary of its radix tree, which reach the router in the ingress's process
(serve/router.py), its ``/metrics`` and its ``/v1/cache/summary``; with them its load (running and
waiting requests, prompt tokens still to compute, measured prefill rate and decode step time:
serve/load.py), which the cost-model router weighs against the cache, and the cached blocks that
retained prefixes cover (``retained``: kv/retention.py), which the router counts as held whatever
its view of the cache says.

KV events (``kv_events_config``, kv_events.py): each replica publishes its own. Its engine binds
the PUB and the replay sockets on free TCP ports of the replica's node (``replica_kv_events``), so
replicas never share an address; the routing stats carry them under ``kv_events`` (with the hash
algorithm and its root, what a subscriber needs to hash prompts as the events do), for the
router's ``cache_view="events"`` and for any other subscriber (the ingress's ``/health`` lists them).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prefixkv.async_engine import AsyncEngine
from prefixkv.config import EngineConfig, KVEventsConfig
from prefixkv.errors import EngineDeadError, EngineFatalError, RequestAbortedError, RequestFailedError
from prefixkv.sampling_params import SamplingParams
from prefixkv.serve.control_log import log_name
from prefixkv.serve.digest import bounded_digest
from prefixkv.serve.load import SpeedMeter
from prefixkv.server.cache_view import TEXT_TOKENS

if TYPE_CHECKING:
    from prefixkv.engine_core.client import EngineCoreClient

logger = logging.getLogger(__name__)

SUMMARY_NODES = 64  # radix nodes in the cache summary each digest carries (the /cache page's view)
MAX_HANDLES = 1 << 16  # retention handles a replica remembers its requests named (release_logged)
LOOKUP_EVERY = 10  # routing-stats periods between two lookups of a control log not created yet

# exception class -> the kind a stream's error item names (checked in order: subclasses first)
ERROR_KINDS = (
    (ValueError, "invalid"),
    (OverflowError, "overloaded"),
    (EngineFatalError, "fatal"),
    (EngineDeadError, "dead"),
    (RequestAbortedError, "aborted"),
    (RequestFailedError, "failed"),
)


def error_kind(e: BaseException) -> str:
    return next((kind for cls, kind in ERROR_KINDS if isinstance(e, cls)), "failed")


@dataclass
class ReplicaRequest:
    """What the ingress hands a replica: the rendered, tokenized prompt and its parameters."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    _prompt: str | None = field(default=None, repr=False)

    @property
    def prompt(self) -> str:
        """The token ids as text, one character per token (offset past the surrogates): what Ray's
        ``PrefixCacheAffinityRouter`` matches (it reads a ``prompt`` attribute), so that it compares
        exactly the token prefixes the engines cache."""
        if self._prompt is None:
            self._prompt = "".join(map(_token_char, self.prompt_token_ids))
        return self._prompt


def _token_char(t: int) -> str:
    return chr(t if t < 0xD800 else t + 0x800)


def replica_kv_events(config: KVEventsConfig, host: str) -> KVEventsConfig:
    """A replica's own event addresses: the PUB and replay sockets bound on free ports of ``host``
    (its node's address), the other fields as configured. One address for every replica would
    collide, so a configured ``endpoint`` or ``replay_endpoint`` is refused (``build_app`` says so)."""
    if not config.enable_kv_cache_events:
        return config
    h = f"[{host}]" if ":" in host else host
    return dataclasses.replace(config, endpoint=f"tcp://{h}:*", replay_endpoint=f"tcp://{h}:*")


def _node_address() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray (tests, a notebook)
        return "127.0.0.1"


def serve_context() -> tuple[str, str]:
    """(this Serve replica's id, its application's name); ("local", "local") outside a deployment
    (tests, a notebook)."""
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        ctx = serve.get_replica_context()
    except RayServeException:
        return "local", "local"
    return ctx.replica_id.unique_id, ctx.app_name


class EngineReplica:
    """The deployment class (``serve.deployment(EngineReplica)`` in serve/app.py)."""

    def __init__(self, engine_config: EngineConfig, cache_view_text: bool = False,
                 digest_max_blocks: int = 1 << 20, engine_process: bool = True) -> None:
        self.replica_id, self.app_name = serve_context()
        if engine_config.kv_events.enable_kv_cache_events:
            engine_config = dataclasses.replace(
                engine_config, kv_events=replica_kv_events(engine_config.kv_events, _node_address()))
        if engine_process:  # its threads: Ray's OMP_NUM_THREADS for the actor (num_cpus), inherited
            from prefixkv.engine_core.client import EngineCoreClient

            self.engine: AsyncEngine | EngineCoreClient = EngineCoreClient.launch(engine_config)
        else:
            self.engine = AsyncEngine.from_config(engine_config)
        self.block_size = engine_config.cache.block_size
        self.digest_max_blocks = digest_max_blocks
        self.summary_text_tokens = TEXT_TOKENS if cache_view_text else 0
        self._grammar_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefixkv-grammar")
        self._digest_seq = itertools.count(1)
        self._speed = SpeedMeter()
        # requests this replica accepted and has not finished: those on their way into the engine
        # (its own process) count too, which the engine's queues do not show yet
        self._active = 0
        self._kv_events: dict[str, Any] | None = None  # where its engine publishes KV events
        # the application's control log (serve/control_log.py), how far this replica has read its
        # releases and its resets, and the retention handles its requests named -> how many of those
        # requests run (the most recent MAX_HANDLES; one the engine still holds beyond them lapses
        # with its TTL): the log's other handles are no business of its engine
        self._log: Any = None
        self._releases_read: tuple[str | None, int] = (None, 0)
        self._resets_read: tuple[str | None, int] = (None, 0)
        self._lookups = 0
        self._handles: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._release_when_ended: set[str] = set()  # released while a request naming it ran
        self._tasks: set[asyncio.Task] = set()
        logger.info("engine replica %s ready (%d KV blocks of %d tokens)", self.replica_id,
                    self.engine.info.num_kv_blocks, self.block_size)

    def describe(self) -> dict[str, Any]:
        """What the ingress needs to parse and check requests without the model."""
        info = self.engine.info
        return {"replica_id": self.replica_id, "max_model_len": info.max_model_len, "vocab_size": info.vocab_size,
                "eos_token_ids": list(info.eos_token_ids), "num_kv_blocks": info.num_kv_blocks,
                "block_size": self.block_size, "max_waiting_requests": self.engine.max_waiting_requests,
                "default_sampling": dict(self.engine.default_sampling)}

    async def generate(self, req: ReplicaRequest):
        self._active += 1
        handle = req.params.kv_retention_handle
        if handle is not None:
            self._handles[handle] = self._handles.get(handle, 0) + 1
            self._handles.move_to_end(handle)
            if len(self._handles) > MAX_HANDLES:
                self._handles.popitem(last=False)
        try:
            try:
                if req.params.structured_outputs is not None:  # compiled off the event loop and the step
                    await asyncio.get_running_loop().run_in_executor(
                        self._grammar_pool, self.engine.compile_grammar, req.params.structured_outputs)
                stream = await self.engine.add_request(req.request_id, req.prompt_token_ids, req.params)
            except Exception as e:
                yield ("error", error_kind(e), str(e))
                return
            yield ("accepted", self.replica_id)
            async with stream:  # leaving early (cancelled by the ingress) aborts the request
                try:
                    async for out in stream:
                        yield out
                except Exception as e:
                    yield ("error", error_kind(e), str(e))
        finally:
            self._active -= 1
            if handle is not None:
                self._request_ended(handle)

    def _request_ended(self, handle: str) -> None:
        live = self._handles.get(handle, 0)
        if live:
            self._handles[handle] = live - 1
        if live <= 1 and handle in self._release_when_ended:
            # released while this request ran (it may have been admitted, and retained, after)
            self._release_when_ended.discard(handle)
            self._handles.pop(handle, None)
            task = asyncio.get_running_loop().create_task(self._release(handle))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _release(self, handle: str) -> None:
        try:
            await self.engine.release_retention(handle)
        except EngineDeadError:
            pass
        except Exception as e:  # the retention then lapses with its TTL
            logger.warning("releasing retention %s: %s: %s", handle, type(e).__name__, e)

    async def _control_log(self) -> Any:
        """The application's control log (serve/control_log.py), or None: none yet (looked up every
        LOOKUP_EVERY-th call, one a routing-stats period, until the ingress has created it) or
        outside a Serve application."""
        if self._log is None:
            import ray

            if self.app_name == "local" or not ray.is_initialized():
                return None
            self._lookups += 1
            if self._lookups % LOOKUP_EVERY != 1:
                return None
            try:  # a call to Ray's control store: off the event loop, which streams tokens
                self._log = await asyncio.to_thread(ray.get_actor, log_name(self.app_name))
            except ValueError:  # not created yet
                return None
        return self._log

    def _log_lost(self) -> None:
        """The log's owner, the ingress, died: the next one logs anew (looked up again)."""
        self._log, self._lookups = None, 0

    async def release_logged(self) -> int:
        """Release in the engine the retentions the ingress logged since the last look (a deleted
        stored Response's) that this replica's requests named; how many it released. Nothing while
        the control log is not found (``_control_log``)."""
        from ray.exceptions import RayError

        log = self._log
        if log is None:
            return 0
        try:
            log_id, end, handles = await log.since.remote(*self._releases_read)
        except RayError:
            self._log_lost()
            return 0
        self._releases_read = (log_id, end)
        mine = [h for h in handles if h in self._handles]
        for handle in mine:
            if self._handles[handle]:  # a request naming it still runs: released again when it ends
                self._release_when_ended.add(handle)
            else:
                del self._handles[handle]
            await self._release(handle)
        return len(mine)

    async def reset_logged(self) -> int:
        """The prefix-cache resets the ingress asked of this replica since the last look (``POST
        /reset_prefix_cache``): one reset of the engine's cache answers them all, reported to the
        log under this replica's id (True reset, False refused: a request runs or waits here); how
        many resets it answered. They stay unread if the engine's reset raises (tried again next
        period; a dead engine stops this replica's running, and the ingress then waits no more)."""
        from ray.exceptions import RayError

        log = self._log
        if log is None:
            return 0
        try:
            log_id, end, numbers = await log.resets_since.remote(*self._resets_read, self.replica_id)
            if numbers:
                done = await self.engine.reset_prefix_cache()
                for number in numbers:
                    await log.report_reset.remote(number, self.replica_id, done)
                logger.info("prefix cache reset (POST /reset_prefix_cache at the ingress, %s): %s", numbers,
                            "done" if done else "refused, requests running")
        except RayError:
            self._log_lost()
            return 0
        self._resets_read = (log_id, end)
        return len(numbers)

    async def record_routing_stats(self) -> dict[str, Any]:
        """The digest of the prefix cache and the engine's statistics, for the router; first what
        the ingress logged since the last period (``release_logged``, ``reset_logged``)."""
        running = self.engine.is_running
        digest: dict[int, int] = {}
        retained: list[int] = []
        summary = load = None
        text_tokens = self.summary_text_tokens
        if running:
            try:
                # the control log looked up (once a period, until found), then what it asks
                for what in (self._control_log, self.release_logged, self.reset_logged):
                    try:
                        await what()
                    except EngineDeadError:
                        raise
                    except Exception as e:  # (not the routing stats' business: they go out regardless)
                        logger.warning("%s: %s: %s", what.__name__, type(e).__name__, e)
                if self._kv_events is None:
                    self._kv_events = await self.engine.kv_events_info()
                digest, retained = await self.engine.routing_digest()
                summary = await self.engine.cache_summary(SUMMARY_NODES, text_tokens)
                # the time before the look: what the router sent after it is added to this load,
                # what it sent while the engine looked may count twice (never not at all)
                looked, active = time.time(), self._active
                load = {"time": looked, **await self.engine.queue_state()}
                load["num_waiting"] = max(load["num_waiting"], active - load["num_running"])
            except EngineDeadError:
                running = False
        digest = bounded_digest(digest, retained, self.digest_max_blocks)
        retained = [h for h in retained if h in digest]
        stats = self.engine.stats()
        if load is not None:  # what the replica reports of its queue and speed, for the router
            load["prefill_tokens_per_s"], load["decode_step_s"] = self._speed.update(stats)
        stats["running"] = running
        return {"replica_id": self.replica_id, "seq": next(self._digest_seq), "time": time.time(),
                "block_size": self.block_size, "digest": digest, "retained": retained, "stats": stats,
                "cache_summary": summary, "load": load, "kv_events": self._kv_events}

    def check_health(self) -> None:
        """Serve's health check: a dead engine makes Serve replace this replica."""
        if self.engine.fatal_error is not None:
            raise RuntimeError(f"the engine is dead: {self.engine.fatal_error}")
        if not self.engine.is_running:
            raise RuntimeError("the engine is not running")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close(timeout=5.0)
