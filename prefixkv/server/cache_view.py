"""The KV-cache view's data, transport-independent: ``GET /v1/cache/summary?max_nodes=N`` answered
from the engine's ``cache_summary()`` (computed between steps, wherever the engine runs), bounded in
size however large the radix tree is (``RadixIndex.summary``), with no prompt text unless the server
allows it. ``server/webui.py`` serves it over aiohttp; any other front end can call ``reply``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from prefixkv.engine_client import EngineClient
from prefixkv.errors import EngineDeadError
from prefixkv.server.protocol import ProtocolError
from prefixkv.server.serving import ApiError, Reply, json_reply

MAX_SUMMARY_NODES = 256
TEXT_TOKENS = 24  # tokens of each shown node decoded when the view may show text
SUMMARY_MAX_AGE_S = 0.2  # one summary serves every poll within this long (several open /cache tabs)


def summary_payload(engine_summary: dict[str, Any], model_name: str, text_shown: bool) -> dict[str, Any]:
    """``/v1/cache/summary``'s body from ``LLMEngine.cache_summary()``."""
    s = engine_summary["stats"]
    total, used, evictable = s["num_kv_blocks"], s["num_kv_blocks_used"], s["num_kv_blocks_evictable"]
    tree = engine_summary["tree"]
    tiers: dict[str, Any] = {"device": {"total": total, "in_use": used, "cached": tree["num_cached_blocks"],
                                        "evictable": evictable, "free": total - used - evictable}}
    if s["num_host_blocks"]:
        tiers["host"] = {"total": s["num_host_blocks"], "used": s["num_host_blocks_used"],
                         "stored": s["host_blocks_stored"], "loaded": s["host_blocks_loaded"]}
    if s["num_disk_blocks"]:
        tiers["disk"] = {"total": s["num_disk_blocks"], "used": s["num_disk_blocks_used"],
                         "bytes_written": s["disk_bytes_written"], "bytes_read": s["disk_bytes_read"]}
    return {
        "object": "cache.summary",
        "model": model_name,
        "time": time.time(),
        "block_size": engine_summary["block_size"],
        "requests": {"running": s["num_running"], "waiting": s["num_waiting"]},
        "tiers": tiers,
        "prefix_cache": {"queried_tokens": s["prefix_queried_tokens"], "hit_tokens": s["prefix_hit_tokens"],
                         "lower_tier_hit_tokens": s["prefix_host_hit_tokens"]},
        "num_preemptions": s["num_preemptions"],
        "text_shown": text_shown,
        "tree": tree,
    }


def parse_max_nodes(raw: str | None, limit: int) -> int:
    """The ``max_nodes`` query parameter (default 64); 400 naming it outside 1 .. ``limit``."""
    raw = "64" if raw is None else raw
    try:
        max_nodes = int(raw)
    except ValueError:
        max_nodes = 0
    if not 1 <= max_nodes <= limit:
        raise ProtocolError(f"max_nodes: must be an integer from 1 to {limit}, got {raw!r}", param="max_nodes")
    return max_nodes


def trim_tree(tree: dict[str, Any], max_nodes: int) -> dict[str, Any]:
    """A summary tree (``RadixIndex.summary``) cut to its first ``max_nodes`` shown nodes,
    breadth first (the order the summary ranks them in)."""
    root = {**tree["root"], "children": []}
    queue = [(child, root) for child in tree["root"]["children"]]
    shown = 0
    while queue and shown < max_nodes:
        node, parent = queue.pop(0)
        copy = {**node, "children": []}
        parent["children"].append(copy)
        shown += 1
        queue.extend((child, copy) for child in node["children"])
    return {**tree, "num_shown_nodes": shown, "root": root}


class CacheSummaries:
    def __init__(self, engine: EngineClient, model_name: str, show_text: bool) -> None:
        self.engine = engine
        self.model_name = model_name
        self.show_text = show_text
        self._recent: dict[int, tuple[float, asyncio.Future]] = {}  # max_nodes -> (when, its summary)

    async def reply(self, max_nodes_param: str | None) -> Reply:
        """The summary for the query parameter ``max_nodes`` (default 64; 400 naming it outside
        1 .. MAX_SUMMARY_NODES; 503 when the engine is not running)."""
        summary = await self._summary(parse_max_nodes(max_nodes_param, MAX_SUMMARY_NODES))
        reply = json_reply(summary_payload(summary, self.model_name, self.show_text))
        reply.headers = {"Cache-Control": "no-store"}
        return reply

    async def _summary(self, max_nodes: int) -> dict[str, Any]:
        """The engine's summary, shared by the polls that arrive within ``SUMMARY_MAX_AGE_S`` of
        each other (and by those waiting for it)."""
        now = time.monotonic()
        hit = self._recent.get(max_nodes)
        if hit is None or now - hit[0] > SUMMARY_MAX_AGE_S or (hit[1].done() and hit[1].exception()):
            text_tokens = TEXT_TOKENS if self.show_text else 0
            future = asyncio.ensure_future(self.engine.cache_summary(max_nodes, text_tokens))
            self._recent = {k: v for k, v in self._recent.items() if now - v[0] <= SUMMARY_MAX_AGE_S}
            self._recent[max_nodes] = hit = (now, future)
        try:
            return await asyncio.shield(hit[1])
        except EngineDeadError as e:
            raise ApiError(503, "the engine is not running", type="server_error", code="engine_dead") from e
