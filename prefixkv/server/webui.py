"""The browser pages ``prefixkv serve`` ships: a chat page at ``/`` and a live view of the KV cache at
``/cache``, both static files (``server/static/``, package data, no build step) over the same
OpenAI routes any client uses, plus the one JSON route the cache view polls::

    GET /v1/cache/summary?max_nodes=64      (behind the API key, as every /v1 route)

The summary (``server/cache_view.py``, no HTTP library there) is bounded in size however large the
radix tree is (``RadixIndex.summary``) and carries no prompt text unless the server was started with
``--cache-view-text``.

The pages never render model text as HTML: markdown goes through marked with raw HTML escaped, then
DOMPurify (both vendored under ``static/vendor`` with their licences), and the pages' Content Security
Policy allows no inline script at all.
"""

from __future__ import annotations

from aiohttp import web

from prefixkv.engine_client import EngineClient
from prefixkv.server.cache_view import MAX_SUMMARY_NODES, TEXT_TOKENS, CacheSummaries  # noqa: F401
from prefixkv.server.pages import PAGE_HEADERS as _PAGE_HEADERS
from prefixkv.server.pages import STATIC_DIR


def _page(name: str):
    async def handler(request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC_DIR / name, headers=_PAGE_HEADERS)
    return handler


class WebUI:
    def __init__(self, engine: EngineClient, model_name: str, show_text: bool) -> None:
        self.summaries = CacheSummaries(engine, model_name, show_text)

    async def cache_summary(self, request: web.Request) -> web.Response:
        reply = await self.summaries.reply(request.query.get("max_nodes"))
        return web.Response(status=reply.status, body=reply.body, content_type=reply.content_type,
                            headers=reply.headers)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/", _page("index.html"))
        app.router.add_get("/cache", _page("cache.html"))
        app.router.add_static("/static/", STATIC_DIR, show_index=False, follow_symlinks=False)
        app.router.add_get("/v1/cache/summary", self.cache_summary)
