"""The browser pages' files and headers, for any transport (``server/webui.py`` serves them over
aiohttp, the Ray Serve ingress over Starlette). No HTTP library here."""

from __future__ import annotations

from pathlib import Path

STATIC_DIR = Path(__file__).parent / "static"
PAGES = {"/": "index.html", "/cache": "cache.html"}

# no inline script or style, nothing from elsewhere, no framing: model text that slipped through the
# renderer still could not run
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; "
                               "form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def static_file(rel: str) -> Path | None:
    """The file under ``static/`` that ``/static/<rel>`` names, or None (missing, a folder, or outside)."""
    root = STATIC_DIR.resolve()
    path = (root / rel).resolve()
    if root not in path.parents or not path.is_file():
        return None
    return path
