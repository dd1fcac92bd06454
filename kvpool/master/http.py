"""The master's HTTP side: Prometheus metrics, health, and the pool snapshot as JSON.

With a credential, every endpoint asks for the operator's bearer token (401 otherwise, with
one line saying how to get it), but ``/health`` answers ``{"status": "ok"}`` to anyone (a
liveness probe carries no token) and ``/metrics`` is open under ``--open_metrics``.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from kvpool.master.service import MasterService
from kvpool.master.status_page import add_routes as add_status_page
from kvpool.security.credentials import Credential

__all__ = ["build_app"]

SERVICE_KEY: web.AppKey[MasterService] = web.AppKey("service", MasterService)


_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _metrics(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    service.metrics.refresh(service)
    return web.Response(
        body=service.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


async def _health(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    if not request.get("operator", True):
        return web.json_response({"status": "ok"})
    return web.json_response(
        {
            "status": "ok",
            "objects": len(service.index),
            "clients": len(service.index.registry.clients),
        }
    )


async def _snapshot(request: web.Request) -> web.Response:
    return web.json_response(request.app[SERVICE_KEY].snapshot())


def _guard(
    tokens: list[str], open_paths: frozenset[str]
) -> Callable[..., Awaitable[web.StreamResponse]]:
    # several while a secret is rotated: the new secret's token and the previous one's
    expected = [f"Bearer {token}".encode() for token in tokens]

    @web.middleware
    async def guard(request: web.Request, handler: _Handler) -> web.StreamResponse:
        given = request.headers.get("Authorization", "").encode()
        operator = bool(sum(hmac.compare_digest(given, e) for e in expected))
        request["operator"] = operator
        if operator or request.path in open_paths:
            return await handler(request)
        why = "a wrong token" if given else "no token"
        raise web.HTTPUnauthorized(
            text=f"{why}: send Authorization: Bearer $(kvpool secret token) (the token of "
            "this cluster's secret)\n",
            headers={"WWW-Authenticate": 'Bearer realm="kvpool"'},
        )

    return guard


def build_app(
    service: MasterService, credential: Credential | None = None, *, open_metrics: bool = False
) -> web.Application:
    """The routes; with a ``credential`` they need its operator token (see above)."""
    middlewares = []
    if credential is not None and credential.is_cluster:
        open_paths = frozenset({"/health", *(("/metrics",) if open_metrics else ())})
        tokens = [c.operator_token() for c in credential.candidates()]
        middlewares.append(_guard(tokens, open_paths))
    app = web.Application(middlewares=middlewares)
    app[SERVICE_KEY] = service
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/health", _health)
    app.router.add_get("/api/status", _snapshot)
    add_status_page(app)  # GET /status
    return app
