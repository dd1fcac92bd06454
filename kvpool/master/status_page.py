"""The master's live status page: ``GET /status`` on the master's one port.

Self-contained HTML, CSS and vanilla JS (no CDN: cluster hosts often have no internet); it
polls ``/api/status`` and ``/metrics`` and keeps its charts' history in the browser, so
the master stores nothing for it.
"""

from __future__ import annotations

from importlib.resources import files

from aiohttp import web

__all__ = ["PAGE_PATH", "add_routes", "page_html"]

PAGE_PATH = "/status"

_PAGE_KEY: web.AppKey[bytes] = web.AppKey("status_page_html", bytes)


def page_html() -> bytes:
    """The page as served (read from the package data)."""
    return files("kvpool.master").joinpath("static/status.html").read_bytes()


async def _page(request: web.Request) -> web.Response:
    return web.Response(
        body=request.app[_PAGE_KEY],
        content_type="text/html",
        charset="utf-8",
        headers={"Cache-Control": "no-cache"},
    )


def add_routes(app: web.Application) -> None:
    """Register ``GET /status`` on the master's HTTP app (read the page once, here)."""
    app[_PAGE_KEY] = page_html()
    app.router.add_get(PAGE_PATH, _page)
