"""What an engine replica reports of its queue and its speed, for the cost-model router
(serve/router.py), and how the router reads it back. No torch, no Ray.

A replica publishes, with every cache digest (serve/replica.py), under ``"load"``::

    time                  the replica's time.time() when it looked (the router adds what it routed since)
    num_running           requests in the running batch
    num_waiting           requests waiting for admission
    num_prefill_tokens    prompt tokens still to compute, over all of them
    prefill_tokens_per_s  measured prefill rate (None until the replica has computed a prompt)
    decode_step_s         measured time of a step of decodes only (None until one ran)

``num_prefill_tokens``: a running request counts its tokens not computed yet; a waiting one its
tokens beyond the prefix its replica's cache holds now (``KVCacheCoordinator.match_prefix``, not
touching the LRU order), for the first ``MATCHED_WAITING`` of the queue; requests past those
count their tokens at the uncached fraction of the matched ones (the matching is bounded, the
estimate is not).

The speeds come from the engine's counters (``LLMEngine.stats``: prompt tokens computed and the
seconds of the steps that computed some; steps of decodes only and their seconds), as averages
over the reports that decay by ``DECAY`` per report: a prefill rate taken over steps that also
carried decodes, as a queue of prompts drains beside running requests.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

MATCHED_WAITING = 64
DECAY = 0.8


def queue_state(engine: Any) -> dict[str, int]:
    """Running and waiting requests and their prompt tokens still to compute. Call it on the engine
    thread, between steps (``AsyncEngine.queue_state``, the core's ``queue_state`` call): it reads the
    scheduler's queues."""
    sched = engine.scheduler
    pending = 0
    for r in sched.running:
        left = r.num_tokens - r.num_computed_tokens
        pending += left if left > 1 else 0  # (1: a decode)
    total = matched = uncached = 0
    for i, r in enumerate(sched.waiting):
        n = r.num_tokens
        total += n
        if i < MATCHED_WAITING:
            matched += n
            uncached += n - sched.kv.match_prefix(r.token_ids, r.block_hashes, touch=False,
                                                      root=r.cache_root).num_tokens
    pending += uncached + (round((total - matched) * uncached / matched) if matched else 0)
    return {"num_running": len(sched.running), "num_waiting": len(sched.waiting), "num_prefill_tokens": pending}


class SpeedMeter:
    """The prefill rate and the decode step time from successive ``LLMEngine.stats()``, as
    decayed sums (tokens and seconds), so a replica that slows down shows it within a few reports."""

    def __init__(self, decay: float = DECAY) -> None:
        self.decay = decay
        self._last: Mapping[str, Any] | None = None
        self._tokens = self._prefill_s = self._steps = self._decode_s = 0.0

    def update(self, stats: Mapping[str, Any]) -> tuple[float | None, float | None]:
        """(prefill tokens/s, seconds per decode step) as of ``stats``; None where nothing was measured."""
        last = self._last or {}
        d = self.decay
        self._tokens = self._tokens * d + stats["num_prefill_tokens"] - last.get("num_prefill_tokens", 0)
        self._prefill_s = self._prefill_s * d + stats["prefill_s"] - last.get("prefill_s", 0.0)
        self._steps = self._steps * d + stats["num_decode_steps"] - last.get("num_decode_steps", 0)
        self._decode_s = self._decode_s * d + stats["decode_s"] - last.get("decode_s", 0.0)
        self._last = dict(stats)
        rate = self._tokens / self._prefill_s if self._prefill_s > 0 and self._tokens > 0 else None
        step = self._decode_s / self._steps if self._steps > 0 and self._decode_s > 0 else None
        return rate, step


class ReplicaLoad(NamedTuple):
    """A replica's published load, as the router reads it."""

    time: float
    num_requests: int  # running + waiting
    num_prefill_tokens: int
    prefill_tokens_per_s: float | None
    decode_step_s: float | None

    @classmethod
    def of(cls, routing_stats: Mapping[str, Any]) -> ReplicaLoad | None:
        """From a replica's routing stats; None before it has published a load."""
        load = routing_stats.get("load")
        if not load:
            return None
        return cls(load["time"], load["num_running"] + load["num_waiting"], load["num_prefill_tokens"],
                   load.get("prefill_tokens_per_s"), load.get("decode_step_s"))
