"""The browser pages ``prefixkv serve`` ships: a chat page at ``/`` and a live view of the KV cache at
``/cache``, both static files (``server/static/``, package data, no build step) over the same
OpenAI routes any client uses, plus the one JSON route the cache view polls::

    GET /v1/cache/summary?max_nodes=64      (behind the API key, as every /v1 route)

The summary is bounded in size however large the radix tree is (``RadixIndex.summary``) and carries
no prompt text unless the server was started with ``--cache-view-text``.

The pages never render model text as HTML: markdown goes through marked with raw HTML escaped, then
DOMPurify (both vendored under ``static/vendor`` with their licences), and the pages' Content Security
Policy allows no inline script at all.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from prefixkv.async_engine import AsyncEngine
from prefixkv.errors import EngineDeadError
from prefixkv.server.protocol import ProtocolError

STATIC_DIR = Path(__file__).parent / "static"
MAX_SUMMARY_NODES = 256
TEXT_TOKENS = 24  # tokens of each shown node decoded when the view may show text

# no inline script or style, nothing from elsewhere, no framing: model text that slipped through the
# renderer still could not run
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; "
                               "form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _page(name: str):
    async def handler(request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC_DIR / name, headers=_PAGE_HEADERS)
    return handler


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


SUMMARY_MAX_AGE_S = 0.2  # one summary serves every poll within this long (several open /cache tabs)


class WebUI:
    def __init__(self, engine: AsyncEngine, model_name: str, show_text: bool) -> None:
        self.engine = engine
        self.model_name = model_name
        self.show_text = show_text
        self._recent: dict[int, tuple[float, asyncio.Future]] = {}  # max_nodes -> (when, its summary)

    async def _summary(self, max_nodes: int) -> dict[str, Any]:
        """The engine's summary, computed on the engine thread between steps, shared by the polls
        that arrive within ``SUMMARY_MAX_AGE_S`` of each other (and by those waiting for it)."""
        now = time.monotonic()
        hit = self._recent.get(max_nodes)
        if hit is None or now - hit[0] > SUMMARY_MAX_AGE_S or (hit[1].done() and hit[1].exception()):
            text_tokens = TEXT_TOKENS if self.show_text else 0
            future = asyncio.ensure_future(self.engine.run(lambda e: e.cache_summary(max_nodes, text_tokens)))
            self._recent = {k: v for k, v in self._recent.items() if now - v[0] <= SUMMARY_MAX_AGE_S}
            self._recent[max_nodes] = hit = (now, future)
        try:
            return await asyncio.shield(hit[1])
        except EngineDeadError as e:
            raise web.HTTPServiceUnavailable(reason="the engine is not running") from e

    async def cache_summary(self, request: web.Request) -> web.Response:
        raw = request.query.get("max_nodes", "64")
        try:
            max_nodes = int(raw)
        except ValueError:
            max_nodes = 0
        if not 1 <= max_nodes <= MAX_SUMMARY_NODES:
            raise ProtocolError(f"max_nodes: must be an integer from 1 to {MAX_SUMMARY_NODES}, got {raw!r}",
                                param="max_nodes")
        summary = await self._summary(max_nodes)
        return web.json_response(summary_payload(summary, self.model_name, self.show_text),
                                 headers={"Cache-Control": "no-store"})

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/", _page("index.html"))
        app.router.add_get("/cache", _page("cache.html"))
        app.router.add_static("/static/", STATIC_DIR, show_index=False, follow_symlinks=False)
        app.router.add_get("/v1/cache/summary", self.cache_summary)
