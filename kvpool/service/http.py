"""The master's HTTP side: Prometheus metrics, health, and the pool snapshot as JSON."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from kvpool.service.master import MasterService
from kvpool.service.status_page import add_routes as add_status_page

__all__ = ["build_app"]

SERVICE_KEY: web.AppKey[MasterService] = web.AppKey("service", MasterService)


async def _metrics(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    service.metrics.refresh(service)
    return web.Response(
        body=service.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


async def _health(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    return web.json_response(
        {
            "status": "ok",
            "objects": len(service.index),
            "clients": len(service.index.registry.clients),
        }
    )


async def _snapshot(request: web.Request) -> web.Response:
    return web.json_response(request.app[SERVICE_KEY].snapshot())


def build_app(service: MasterService) -> web.Application:
    app = web.Application()
    app[SERVICE_KEY] = service
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/health", _health)
    app.router.add_get("/api/status", _snapshot)
    add_status_page(app)  # GET /status
    return app
