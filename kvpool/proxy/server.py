"""The P/D proxy server: an OpenAI-compatible front for prefill/decode pairs (aiohttp).

One request, two legs (docs/proxy.md): P with ``max_tokens=1``, whose token goes to the
client at once, then D with the prompt ids and P's token, whose tokens follow.
"""

from __future__ import annotations

import asyncio
import errno
import time
import uuid
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from kvpool.errors import ConfigError
from kvpool.proxy.auth import ApiKeys
from kvpool.proxy.block_index import BlockIndex, content_keys
from kvpool.proxy.config import ProxyConfig
from kvpool.proxy.first_token import (
    can_mend,
    ends_the_answer,
    first_token,
    merge_whole,
    p_only_reply,
    prefill_request_for,
    refusal,
    splittable,
)
from kvpool.proxy.first_token import (
    decode_request as continuation_request,
)
from kvpool.proxy.health import HealthChecker
from kvpool.proxy.kv_feed import KvFeed
from kvpool.proxy.legs import STATUS_KEY, TIMEOUT_ERRORS, Legs, json_error
from kvpool.proxy.metrics import ProxyMetrics
from kvpool.proxy.openai import (
    CHAT,
    COMPLETIONS,
    decode_request,
    error_body,
    prefill_request,
    upstream_error,
    validate_request,
)
from kvpool.proxy.routing import (
    KvAware,
    Prompt,
    Route,
    Upstream,
    UpstreamGroup,
    make_routing_policy,
    prefix_key,
)
from kvpool.proxy.splice import Splice

__all__ = ["ProxyServer"]

_PATHS = {COMPLETIONS: "/v1/completions", CHAT: "/v1/chat/completions"}
# Long prompts and inline images are large; aiohttp's 1 MiB default would refuse them.
_MAX_BODY_BYTES = 64 * 1024 * 1024
# A liveness probe carries no key (vLLM too leaves /health open); it learns only the status.
_OPEN_PATHS = frozenset({"/health"})


# Lifecycle (as uvicorn): ``ProxyServer(config)`` has no side effects; ``await start()``
# binds and starts the health checker; ``await stop()`` stops accepting, lets in-flight
# requests finish (up to ``shutdown_timeout_s``) and closes every upstream connection.
# ``kvpool up`` can run it in-process this way, or run ``kvpool proxy`` as a subprocess.
#
# API keys (``--api-key``, :mod:`kvpool.proxy.auth`): with one configured, every path but
# ``/health`` (and ``/metrics`` with ``--open-metrics``) needs ``Authorization: Bearer KEY``;
# anything else gets a 401 in OpenAI's shape before P or D is called.  P and D get the
# proxy's upstream key instead of the client's.
#
# Failure rules:
# - Nothing has been sent to the client yet → a proper HTTP error in OpenAI's shape: the
#   upstream's own status and message, 502 when an upstream cannot be reached or breaks off,
#   504 on an upstream timeout, 503 when no endpoint of a role is in rotation, 400 for a
#   request the proxy cannot route.
# - A connect failure is retried on another endpoint of the same role (nothing was sent).
# - D fails after its first bytes were passed on → an SSE error event, no ``[DONE]``.
# - The client disconnects → the handler is cancelled and both upstream responses are
#   closed, so vLLM aborts the request.
class ProxyServer:
    """Routes OpenAI requests through one P and one D endpoint each."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.metrics = ProxyMetrics()
        # kv_aware: what each prefill's own cache and the pool hold, from their KV events
        self.pool_blocks = BlockIndex(config.kv_max_blocks) if config.kv_events else None
        policy = (
            KvAware(self.pool_blocks if config.kv_pool else None)
            if config.policy == "kv_aware"
            else make_routing_policy(config.policy)
        )
        self.prefill = UpstreamGroup("prefill", config.prefill, policy)
        self.decode = UpstreamGroup(
            "decode", config.decode, make_routing_policy(config.effective_decode_policy)
        )
        self._use_key = config.policy == "prefix_affinity"
        self._feed: KvFeed | None = None
        self._tokenize_turn = 0
        if self.pool_blocks is not None:
            upstreams = {u.url: u for g in (self.prefill, self.decode) for u in g.upstreams}
            self._feed = KvFeed(
                config.kv_events,
                upstreams,
                self.pool_blocks,
                self.metrics,
                max_blocks=config.kv_max_blocks,
            )
        self._keys = ApiKeys(config.api_keys) if config.api_keys else None
        self._open_paths = _OPEN_PATHS | ({"/metrics"} if config.open_metrics else set())
        upstream_key = config.effective_upstream_key
        self._upstream_auth = None if upstream_key is None else f"Bearer {upstream_key}"
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._health: HealthChecker | None = None
        self._legs: Legs | None = None
        for group in (self.prefill, self.decode):
            for up in group.upstreams:
                self.metrics.upstream_healthy.labels(group.role, up.url).set(1)
                self.metrics.upstream_inflight.labels(group.role, up.url).set(0)

    # -- lifecycle ---------------------------------------------------------------------

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=_MAX_BODY_BYTES, middlewares=[self._auth])
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
            # idle upstream connections are dropped before vLLM's server (uvicorn, 5 s
            # keep-alive) drops them, so a request never lands on a half-closed one
            connector=aiohttp.TCPConnector(limit=cfg.max_connections, keepalive_timeout=4.0),
            auto_decompress=False,  # pass D's bytes through untouched
        )
        self._legs = Legs(self._session, self.prefill, self.decode, self.metrics)
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
        except OSError as exc:
            await self.stop()
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"--port {cfg.port}: {cfg.host}:{cfg.port} is already in use (another"
                    " kvpool proxy?); stop it or choose another --port"
                ) from None
            raise
        except BaseException:
            await self.stop()
            raise
        await self._health.start()
        if self._feed is not None:
            await self._feed.start(self._session)

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
        if self._feed is not None:
            await self._feed.stop()
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

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """With API keys, every path but the open ones needs one (unknown paths too, so
        a caller without a key cannot even map the API); the refusal never reaches P or D."""
        if self._keys is not None and request.path not in self._open_paths:
            problem = self._keys.problem(request.headers.get("Authorization"))
            if problem is not None:
                self.metrics.errors.labels("client", "unauthorized").inc()
                body = error_body(401, problem, "invalid_request_error")
                body["error"]["code"] = "invalid_api_key"
                return web.json_response(
                    body, status=401, headers={"WWW-Authenticate": 'Bearer realm="kvpool"'}
                )
        response: web.StreamResponse = await handler(request)
        return response

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
        status = 200 if ready else 503
        state = "ok" if ready else "unavailable"
        if self._keys is not None and self._keys.problem(request.headers.get("Authorization")):
            # the endpoints' addresses and errors are for the key's holders only
            return web.json_response({"status": state}, status=status)
        body["status"] = state
        return web.json_response(body, status=status)

    async def _metrics_page(self, request: web.Request) -> web.Response:
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
                async with self._session.get(
                    up.url + "/v1/models", headers=self._upstream_headers(request)
                ) as resp:
                    raw = await resp.read()
                    if resp.status != 200:
                        last_error = f"{up.url}: " + upstream_error(resp.status, raw)[0]
                        continue
                    data = msgspec.json.decode(raw).get("data", [])
            except (aiohttp.ClientError, *TIMEOUT_ERRORS, ValueError, AttributeError) as exc:
                last_error = f"{up.url}: {exc!r}"
                continue
            for model in data if isinstance(data, list) else []:
                if isinstance(model, dict) and "id" in model:
                    models.setdefault(model["id"], model)
        if not models:
            return json_error(503, f"no decode endpoint listed its models ({last_error})")
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
            status = request.get(STATUS_KEY, response.status)
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
            return json_error(400, f"request body is not valid JSON: {exc}")
        problem = validate_request(kind, body)
        if problem is not None:
            self.metrics.errors.labels("request", "bad_request").inc()
            return json_error(400, problem)
        headers = {
            "Content-Type": "application/json",
            # vLLM names its request after this header; both legs share it
            "X-Request-Id": request.headers.get("X-Request-Id") or f"kvpool-{uuid.uuid4().hex}",
            **self._upstream_headers(request),
        }
        path = _PATHS[kind]
        key = prefix_key(body, self.config.prefix_chars) if self._use_key else None
        route = await self._route_of(kind, body, key, headers)

        if self.config.first_token_from == "prefill":
            problem = refusal(body)
            if problem is not None:
                self.metrics.errors.labels("request", "bad_request").inc()
                return json_error(400, problem)
            if splittable(kind, body):
                return await self._first_from_prefill(kind, request, body, headers, route)
        assert self._legs is not None
        started = time.perf_counter()
        kv_or_error = await self._legs.prefill_leg(
            path, prefill_request(kind, body), headers, route
        )
        if isinstance(kv_or_error, web.Response):
            return kv_or_error
        payload = decode_request(body, kv_or_error or None)
        return await self._legs.decode_leg(
            request, path, payload, headers, bool(body.get("stream")),
            prefill_s=time.perf_counter() - started,
        )  # fmt: skip

    async def _first_from_prefill(
        self,
        kind: str,
        request: web.Request,
        body: dict[str, Any],
        headers: dict[str, str],
        route: Route,
    ) -> web.StreamResponse:
        """P's token first, D continuing from it (``--first-token-from prefill``)."""
        assert self._legs is not None
        legs, path, stream = self._legs, _PATHS[kind], bool(body.get("stream"))
        started = time.perf_counter()
        reply = await legs.prefill_reply(path, prefill_request_for(kind, body), headers, route)
        if isinstance(reply, web.Response):
            return reply
        prefill_s = time.perf_counter() - started
        first = first_token(kind, reply)
        ends = first is not None and ends_the_answer(kind, body, first)
        if first is None or (first.split and not ends and not can_mend(body)):
            # a vLLM that does not return token ids, or P's token is part of a character
            # and the request has what mending cannot honour: D answers the whole request
            # (the sequential way)
            self.metrics.first_token.labels("sequential").inc()
            payload = decode_request(body, legs.kv_of(reply))
            return await legs.decode_leg(request, path, payload, headers, stream, prefill_s)
        if not ends and first.kv_transfer_params is None:
            legs.kv_of(reply)  # counted: D recomputes the prompt
        d_payload = None if ends else continuation_request(kind, body, first)
        path_taken = "p_only" if ends else "mended" if first.split else "spliced"
        self.metrics.first_token.labels(path_taken).inc()
        if stream:
            splice = Splice(kind, body, first)
            return await legs.spliced_stream(request, path, d_payload, headers, splice, prefill_s)
        timing = {"Server-Timing": f"prefill;dur={prefill_s * 1000:.1f}"}
        if d_payload is None:
            return web.json_response(p_only_reply(kind, body, first), headers=timing)
        whole = await legs.decode_whole(path, d_payload, headers, first)
        if isinstance(whole, web.Response):
            return whole
        d_reply, mended = whole
        return web.json_response(merge_whole(kind, body, first, d_reply, mended), headers=timing)

    async def _route_of(
        self, kind: str, body: dict[str, Any], key: bytes | None, headers: dict[str, str]
    ) -> Route:
        """How this request is routed: with ``kv_aware``, its prompt's blocks (token ids
        from a prefill's ``/tokenize``) and the feedback of what the chosen one hit."""
        feed = self._feed
        if feed is None or not isinstance(self.prefill.policy, KvAware):
            return Route(key)
        block_size = next((u.blocks.block_size for u in self.prefill.upstreams
                           if u.blocks is not None and u.blocks.block_size), None)  # fmt: skip
        if block_size is None:  # no events yet: least loaded
            return Route(key)
        tokens = await self._tokenize(kind, body, headers)
        if tokens is None:
            return Route(key)
        keys = tuple(content_keys(tokens, block_size))
        predicted: dict[str, tuple[int, int]] = {}
        policy = self.prefill.policy

        def on_pick(up: Upstream) -> None:
            predicted[up.url] = policy.predicted.get(up.url, (0, 0))

        def on_reply(up: Upstream, reply: dict[str, Any]) -> None:
            feed.observe(up.url, predicted.get(up.url, (0, 0)), keys, block_size, _cached(reply))

        return Route(key, Prompt(keys, len(tokens), time.monotonic()), on_pick, on_reply)

    async def _tokenize(
        self, kind: str, body: dict[str, Any], headers: dict[str, str]
    ) -> list[int] | None:
        """The prompt's token ids as the prefills see them: given, or from one of them."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        healthy = self.prefill.healthy()
        if not healthy or self._session is None:
            return None
        ask: dict[str, Any] = {"model": body.get("model")}
        if kind == "chat":
            ask.update(messages=body.get("messages"), add_generation_prompt=True)
            for field in ("chat_template", "chat_template_kwargs", "add_generation_prompt"):
                if field in body:
                    ask[field] = body[field]
        elif isinstance(prompt, str):
            ask["prompt"] = prompt
        else:
            return None
        up = healthy[self._tokenize_turn % len(healthy)]
        self._tokenize_turn += 1
        try:
            async with self._session.post(
                up.url + "/tokenize",
                json=ask,
                headers={k: v for k, v in headers.items() if k != "Content-Type"},
                timeout=aiohttp.ClientTimeout(total=self.config.connect_timeout_s),
            ) as reply:
                if reply.status != 200:
                    return None
                tokens = (await reply.json()).get("tokens")
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            return None
        return tokens

    def _upstream_headers(self, request: web.Request) -> dict[str, str]:
        """P and D get the proxy's upstream key when it has one (the client's key is the
        proxy's, not theirs), else the client's own ``Authorization`` as it came."""
        if self._upstream_auth is not None:
            return {"Authorization": self._upstream_auth}
        if "Authorization" in request.headers:
            return {"Authorization": request.headers["Authorization"]}
        return {}


def _cached(reply: dict[str, Any]) -> int | None:
    """The prompt tokens P's reply says were cached (vLLM's prefix cache and connector
    hits; ``--enable-prompt-tokens-details``), or None when it does not say."""
    usage = reply.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) else None
