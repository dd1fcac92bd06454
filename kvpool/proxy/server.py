"""The P/D proxy server: an OpenAI-compatible front for prefill/decode pairs (aiohttp).

One request, two legs (seed §1.1)::

    client ─► proxy ─► P   max_tokens=1, stream=false,
                │          kv_transfer_params={"do_remote_decode": true}
                │      ◄─  JSON reply with kv_transfer_params (where P left the KV)
                └────► D   the original request + P's kv_transfer_params
    client ◄───────────    D's answer, streamed through as it comes

Lifecycle (as uvicorn): ``ProxyServer(config)`` has no side effects; ``await start()``
binds and starts the health checker; ``await stop()`` stops accepting, lets in-flight
requests finish (up to ``shutdown_timeout_s``) and closes every upstream connection.
``kvpool up`` can run it in-process this way, or run ``kvpool proxy`` as a subprocess.

Failure rules:
- Nothing has been sent to the client yet → a proper HTTP error in OpenAI's shape: the
  upstream's own status and message, 502 when an upstream cannot be reached or breaks off,
  504 on an upstream timeout, 503 when no endpoint of a role is in rotation, 400 for a
  request the proxy cannot route.
- A connect failure is retried on another endpoint of the same role (nothing was sent).
- D fails after the stream started → an SSE error event and no ``[DONE]``.
- The client disconnects → the handler is cancelled and both upstream responses are
  closed, so vLLM aborts the request.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from kvpool.proxy.config import ProxyConfig
from kvpool.proxy.health import HealthChecker
from kvpool.proxy.metrics import ProxyMetrics
from kvpool.proxy.openai import (
    CHAT,
    COMPLETIONS,
    decode_request,
    error_body,
    prefill_request,
    stream_error_event,
    upstream_error,
    validate_request,
)
from kvpool.proxy.routing import Upstream, UpstreamGroup, make_policy, prefix_key

__all__ = ["ProxyServer"]

log = logging.getLogger("kvpool.proxy")

_PATHS = {COMPLETIONS: "/v1/completions", CHAT: "/v1/chat/completions"}
# Long prompts and inline images are large; aiohttp's 1 MiB default would refuse them.
_MAX_BODY_BYTES = 64 * 1024 * 1024
_STATUS_KEY = web.RequestKey("kvpool_status", int)
_CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
_TIMEOUT_ERRORS = (aiohttp.ServerTimeoutError, TimeoutError)


def _json_error(
    status: int, message: str, type_: str | None = None, upstream: str | None = None
) -> web.Response:
    headers = {"X-Kvpool-Upstream": upstream} if upstream else None
    return web.json_response(error_body(status, message, type_), status=status, headers=headers)


class ProxyServer:
    """Routes OpenAI requests through one P and one D endpoint each."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.metrics = ProxyMetrics()
        self.prefill = UpstreamGroup("prefill", config.prefill, make_policy(config.policy))
        self.decode = UpstreamGroup(
            "decode", config.decode, make_policy(config.effective_decode_policy)
        )
        self._use_key = config.policy == "prefix_affinity"
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._health: HealthChecker | None = None
        for group in (self.prefill, self.decode):
            for up in group.upstreams:
                self.metrics.upstream_healthy.labels(group.role, up.url).set(1)
                self.metrics.upstream_inflight.labels(group.role, up.url).set(0)

    # -- lifecycle ---------------------------------------------------------------------

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=_MAX_BODY_BYTES)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health_page)
        app.router.add_get("/metrics", self._metrics_page)
        return app

    async def start(self) -> None:
        cfg = self.config
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=cfg.connect_timeout_s,
            sock_connect=cfg.connect_timeout_s,
            sock_read=cfg.read_timeout_s,
        )
        self._session = aiohttp.ClientSession(
            timeout=timeout,
            connector=aiohttp.TCPConnector(limit=cfg.max_connections),
            auto_decompress=False,  # pass D's bytes through untouched
        )
        self._health = HealthChecker(
            [self.prefill, self.decode], cfg.health_interval_s, cfg.health_timeout_s, self.metrics
        )
        self._runner = web.AppRunner(
            self.build_app(),
            access_log=None,
            # cancel the handler when the client goes away: that closes the upstream legs
            handler_cancellation=True,
            shutdown_timeout=cfg.shutdown_timeout_s,
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, cfg.host, cfg.port)
        try:
            await site.start()
        except BaseException:
            await self.stop()
            raise
        await self._health.start()

    @property
    def port(self) -> int:
        if self._runner is None or not self._runner.addresses:
            raise RuntimeError("the proxy is not started")
        return int(self._runner.addresses[0][1])

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    async def check_health(self) -> None:
        """One health round now, without waiting for the interval."""
        if self._health is None:
            raise RuntimeError("the proxy is not started")
        await self._health.poll_once()

    async def stop(self) -> None:
        if self._health is not None:
            await self._health.stop()
            self._health = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- handlers ----------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(COMPLETIONS, request)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(CHAT, request)

    async def _health_page(self, request: web.Request) -> web.Response:
        roles = {g.role: g for g in (self.prefill, self.decode)}
        body: dict[str, Any] = {
            role: [
                {"url": u.url, "healthy": u.healthy, "inflight": u.inflight, "error": u.last_error}
                for u in group.upstreams
            ]
            for role, group in roles.items()
        }
        ready = all(group.healthy() for group in roles.values())
        body["status"] = "ok" if ready else "unavailable"
        return web.json_response(body, status=200 if ready else 503)

    async def _metrics_page(self, request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return web.Response(
            body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def _models(self, request: web.Request) -> web.Response:
        """The models the decode endpoints serve, merged by id."""
        assert self._session is not None
        models: dict[str, Any] = {}
        last_error = "no healthy decode endpoint"
        for up in self.decode.healthy():
            try:
                async with self._session.get(up.url + "/v1/models") as resp:
                    raw = await resp.read()
                    if resp.status != 200:
                        last_error = f"{up.url}: " + upstream_error(resp.status, raw)[0]
                        continue
                    data = msgspec.json.decode(raw).get("data", [])
            except (aiohttp.ClientError, *_TIMEOUT_ERRORS, ValueError, AttributeError) as exc:
                last_error = f"{up.url}: {exc!r}"
                continue
            for model in data if isinstance(data, list) else []:
                if isinstance(model, dict) and "id" in model:
                    models.setdefault(model["id"], model)
        if not models:
            return _json_error(503, f"no decode endpoint listed its models ({last_error})")
        return web.json_response({"object": "list", "data": list(models.values())})

    # -- the two legs ------------------------------------------------------------------

    async def _serve(self, kind: str, request: web.Request) -> web.StreamResponse:
        path = _PATHS[kind]
        started = time.perf_counter()
        m = self.metrics
        m.inflight.inc()
        status = 499  # nginx's "client closed request", kept if we are cancelled
        try:
            response = await self._route(kind, request)
            status = request.get(_STATUS_KEY, response.status)
            return response
        except asyncio.CancelledError:
            m.errors.labels("client", "disconnect").inc()
            raise
        finally:
            m.inflight.dec()
            m.requests.labels(path, str(status)).inc()
            m.request_seconds.labels(path).observe(time.perf_counter() - started)

    async def _route(self, kind: str, request: web.Request) -> web.StreamResponse:
        try:
            body = msgspec.json.decode(await request.read())
        except ValueError as exc:
            self.metrics.errors.labels("request", "bad_json").inc()
            return _json_error(400, f"request body is not valid JSON: {exc}")
        problem = validate_request(kind, body)
        if problem is not None:
            self.metrics.errors.labels("request", "bad_request").inc()
            return _json_error(400, problem)
        headers = {
            "Content-Type": "application/json",
            # vLLM names its request after this header; both legs share it
            "X-Request-Id": request.headers.get("X-Request-Id") or f"kvpool-{uuid.uuid4().hex}",
        }
        if "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        path = _PATHS[kind]
        key = prefix_key(body, self.config.prefix_chars) if self._use_key else None

        kv_or_error = await self._prefill_leg(path, prefill_request(kind, body), headers, key)
        if isinstance(kv_or_error, web.Response):
            return kv_or_error
        payload = decode_request(body, kv_or_error or None)
        return await self._decode_leg(request, path, payload, headers, bool(body.get("stream")))

    async def _open(
        self,
        group: UpstreamGroup,
        path: str,
        payload: dict[str, Any],
        headers: dict[str, str],
        key: bytes | None,
    ) -> tuple[Upstream, aiohttp.ClientResponse] | web.Response:
        """Send to one endpoint of the group, trying the next one on a connect failure.
        On success the upstream is acquired and the response is 200; the caller releases."""
        assert self._session is not None
        data = msgspec.json.encode(payload)
        tried: set[str] = set()
        last_error = ""
        while True:
            up = group.pick(key, frozenset(tried))
            if up is None:
                if tried:
                    return _json_error(502, f"no {group.role} endpoint reachable: {last_error}")
                return _json_error(503, f"no healthy {group.role} endpoint in rotation")
            tried.add(up.url)
            self._acquire(group, up)
            try:
                resp = await self._session.post(up.url + path, data=data, headers=headers)
            except _CONNECT_ERRORS as exc:
                self._release(group, up)
                last_error = f"{up.url}: {exc}"
                self._fail(group, up, "connect", last_error)
                continue
            except _TIMEOUT_ERRORS:
                self._release(group, up)
                message = f"{group.role} endpoint {up.url} timed out"
                self._fail(group, up, "timeout", message)
                return _json_error(504, message, upstream=up.url)
            except aiohttp.ClientError as exc:
                self._release(group, up)
                message = f"{group.role} endpoint {up.url} failed: {exc!r}"
                self._fail(group, up, "disconnect", message)
                return _json_error(502, message, upstream=up.url)
            except BaseException:
                self._release(group, up)
                raise
            if resp.status == 200:
                return up, resp
            try:
                raw = await resp.read()
            except (aiohttp.ClientError, *_TIMEOUT_ERRORS):
                raw = b""
            finally:
                resp.close()
                self._release(group, up)
            message, type_ = upstream_error(resp.status, raw)
            if resp.status >= 500:
                self._fail(group, up, "upstream_5xx", f"HTTP {resp.status}: {message}")
            else:
                self.metrics.errors.labels(group.role, "upstream_4xx").inc()
            return _json_error(resp.status, message, type_, upstream=up.url)

    async def _prefill_leg(
        self, path: str, payload: dict[str, Any], headers: dict[str, str], key: bytes | None
    ) -> dict[str, Any] | web.Response | None:
        started = time.perf_counter()
        opened = await self._open(self.prefill, path, payload, headers, key)
        if isinstance(opened, web.Response):
            return opened
        up, resp = opened
        try:
            raw = await resp.read()
        except _TIMEOUT_ERRORS:
            self._fail(self.prefill, up, "timeout", f"prefill endpoint {up.url} timed out")
            return _json_error(504, f"prefill endpoint {up.url} timed out", upstream=up.url)
        except aiohttp.ClientError as exc:
            message = f"prefill endpoint {up.url} broke off its reply: {exc!r}"
            self._fail(self.prefill, up, "disconnect", message)
            return _json_error(502, message, upstream=up.url)
        finally:
            resp.close()
            self._release(self.prefill, up)
        self.metrics.prefill_seconds.observe(time.perf_counter() - started)
        try:
            kv = msgspec.json.decode(raw).get("kv_transfer_params")
        except (ValueError, AttributeError):
            self.metrics.errors.labels("prefill", "bad_reply").inc()
            return _json_error(
                502, f"prefill endpoint {up.url} sent a reply that is not a JSON object"
            )
        if not isinstance(kv, dict):
            self.metrics.prefill_without_kv.inc()
            return None
        return kv

    async def _decode_leg(
        self,
        request: web.Request,
        path: str,
        payload: dict[str, Any],
        headers: dict[str, str],
        stream: bool,
    ) -> web.StreamResponse:
        started = time.perf_counter()
        opened = await self._open(self.decode, path, payload, headers, None)
        if isinstance(opened, web.Response):
            return opened
        up, resp = opened
        try:
            if not stream:
                return await self._relay_whole(up, resp)
            return await self._relay_stream(request, up, resp, headers["X-Request-Id"])
        finally:
            # closing (not releasing) an unfinished reply drops the connection, which is
            # how vLLM learns that the client is gone and aborts the request
            resp.close()
            self._release(self.decode, up)
            self.metrics.decode_seconds.observe(time.perf_counter() - started)

    async def _relay_whole(self, up: Upstream, resp: aiohttp.ClientResponse) -> web.Response:
        try:
            raw = await resp.read()
        except _TIMEOUT_ERRORS:
            self._fail(self.decode, up, "timeout", f"decode endpoint {up.url} timed out")
            return _json_error(504, f"decode endpoint {up.url} timed out", upstream=up.url)
        except aiohttp.ClientError as exc:
            message = f"decode endpoint {up.url} broke off its reply: {exc!r}"
            self._fail(self.decode, up, "disconnect", message)
            return _json_error(502, message, upstream=up.url)
        content_type = resp.headers.get("Content-Type", "application/json")
        return web.Response(body=raw, headers={"Content-Type": content_type})

    async def _relay_stream(
        self, request: web.Request, up: Upstream, resp: aiohttp.ClientResponse, request_id: str
    ) -> web.StreamResponse:
        out = web.StreamResponse(
            headers={
                "Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
                "Cache-Control": "no-cache",
                "X-Request-Id": request_id,
            }
        )
        await out.prepare(request)
        try:
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
        except ConnectionResetError:
            # the client went away between two chunks (when cancellation did not get there
            # first); the finally of _decode_leg closes D's reply
            self.metrics.errors.labels("client", "disconnect").inc()
            request[_STATUS_KEY] = 499
            return out
        except _TIMEOUT_ERRORS:
            message = f"decode endpoint {up.url} timed out mid-stream"
            self._fail(self.decode, up, "timeout", message)
            return await self._end_with_error(request, out, 504, message)
        except aiohttp.ClientError as exc:
            message = f"decode endpoint {up.url} broke off the stream: {exc!r}"
            self._fail(self.decode, up, "stream", message)
            return await self._end_with_error(request, out, 502, message)
        await out.write_eof()
        return out

    async def _end_with_error(
        self, request: web.Request, out: web.StreamResponse, status: int, message: str
    ) -> web.StreamResponse:
        request[_STATUS_KEY] = status
        try:
            await out.write(stream_error_event(status, message))
            await out.write_eof()
        except ConnectionResetError:
            pass  # the client is gone too; nothing left to tell
        return out

    # -- bookkeeping ---------------------------------------------------------------------

    def _acquire(self, group: UpstreamGroup, up: Upstream) -> None:
        group.acquire(up)
        self.metrics.upstream_inflight.labels(group.role, up.url).set(up.inflight)

    def _release(self, group: UpstreamGroup, up: Upstream) -> None:
        group.release(up)
        self.metrics.upstream_inflight.labels(group.role, up.url).set(up.inflight)

    def _fail(self, group: UpstreamGroup, up: Upstream, kind: str, reason: str) -> None:
        """Count the failure and take the endpoint out until its /health answers again."""
        self.metrics.errors.labels(group.role, kind).inc()
        if group.mark_down(up.url, reason):
            self.metrics.upstream_healthy.labels(group.role, up.url).set(0)
            log.warning("%s endpoint %s out of rotation: %s", group.role, up.url, reason)
