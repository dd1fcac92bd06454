"""The two upstream legs of a request: open one, relay one, and account for both; the
failure rules are on :class:`~kvpool.proxy.server.ProxyServer`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from kvpool.proxy.first_token import FirstToken, mended_text
from kvpool.proxy.metrics import ProxyMetrics
from kvpool.proxy.openai import error_body, stream_error_event, upstream_error
from kvpool.proxy.routing import Route, Upstream, UpstreamGroup
from kvpool.proxy.splice import Splice

__all__ = ["STATUS_KEY", "TIMEOUT_ERRORS", "Legs", "json_error"]

log = logging.getLogger("kvpool.proxy")

# the status to count in metrics when it differs from the response's (a stream that
# failed after its 200 went out, a client that left)
STATUS_KEY = web.RequestKey("kvpool_status", int)
CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
TIMEOUT_ERRORS = (aiohttp.ServerTimeoutError, TimeoutError)
# what an exchange with an upstream can fail with once it is connected (timeouts first:
# aiohttp's ServerTimeoutError is a ClientError too)
UPSTREAM_ERRORS = (*TIMEOUT_ERRORS, aiohttp.ClientError)


@dataclass(frozen=True, slots=True)
class _Step:
    """One step of an exchange with an upstream, as its failures are told and counted."""

    timed_out: str  # what a timeout says: "timed out", "timed out mid-stream"
    broke: str  # what a broken connection says: "failed", "broke off its reply", ...
    kind: str  # the error kind a broken connection is counted as


_SEND = _Step("timed out", "failed", "disconnect")  # posting the request, up to its status
_REPLY = _Step("timed out", "broke off its reply", "disconnect")  # reading a whole reply
_STREAM = _Step("timed out mid-stream", "broke off the stream", "stream")  # after the 200


@dataclass(frozen=True, slots=True)
class _Timing:
    """Where a request's time to first bytes went, for its ``Server-Timing`` header (the
    W3C header browsers and curl -v show): the P leg, then the D leg up to D's first bytes
    (the whole reply when not streaming).  This is how a slow hop is split without logs."""

    prefill_s: float
    decode_started: float  # perf_counter() when the D leg was sent

    def header(self) -> str:
        decode_ms = (time.perf_counter() - self.decode_started) * 1000
        return f"prefill;dur={self.prefill_s * 1000:.1f}, decode_first;dur={decode_ms:.1f}"


def json_error(
    status: int, message: str, type_: str | None = None, upstream: str | None = None
) -> web.Response:
    headers = {"X-Kvpool-Upstream": upstream} if upstream else None
    return web.json_response(error_body(status, message, type_), status=status, headers=headers)


def _message_of(response: web.Response) -> str:
    """The message of one of :func:`json_error`'s replies."""
    body = response.body if isinstance(response.body, (bytes, bytearray)) else b"{}"
    try:
        error = msgspec.json.decode(body or b"{}").get("error", {})
        return str(error.get("message", f"HTTP {response.status}"))
    except (ValueError, AttributeError, TypeError):
        return f"HTTP {response.status}"


class Legs:
    """Sends the P and D legs through one client session."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        prefill: UpstreamGroup,
        decode: UpstreamGroup,
        metrics: ProxyMetrics,
    ) -> None:
        self.session = session
        self.prefill = prefill
        self.decode = decode
        self.metrics = metrics

    async def _open(
        self,
        group: UpstreamGroup,
        path: str,
        payload: dict[str, Any],
        headers: dict[str, str],
        route: Route | None,
    ) -> tuple[Upstream, aiohttp.ClientResponse] | web.Response:
        """Send to one endpoint of the group, trying the next one on a connect failure.
        On success the upstream is acquired and the response is 200; the caller releases."""
        data = msgspec.json.encode(payload)
        tried: set[str] = set()
        last_error = ""
        while True:
            if route is None:
                up = group.pick(None, frozenset(tried))
            else:
                up = group.pick(route.key, frozenset(tried), route.prompt)
                if up is not None and route.on_pick is not None:
                    route.on_pick(up)  # before anything else picks: the prediction is its
            if up is None:
                if tried:
                    return json_error(502, f"no {group.role} endpoint reachable: {last_error}")
                return json_error(503, f"no healthy {group.role} endpoint in rotation")
            tried.add(up.url)
            self._acquire(group, up)
            try:
                resp = await self.session.post(up.url + path, data=data, headers=headers)
            except CONNECT_ERRORS as exc:
                self._release(group, up)
                last_error = f"{up.url}: {exc}"
                self._fail(group, up, "connect", last_error)
                continue
            except UPSTREAM_ERRORS as exc:
                self._release(group, up)
                return self._failure_reply(group, up, exc, _SEND)
            except BaseException:
                self._release(group, up)
                raise
            if resp.status == 200:
                return up, resp
            try:
                raw = await resp.read()
            except (aiohttp.ClientError, *TIMEOUT_ERRORS):
                raw = b""
            finally:
                resp.close()
                self._release(group, up)
            message, type_ = upstream_error(resp.status, raw)
            if resp.status >= 500:
                self._fail(group, up, "upstream_5xx", f"HTTP {resp.status}: {message}")
            else:
                self.metrics.errors.labels(group.role, "upstream_4xx").inc()
            return json_error(resp.status, message, type_, upstream=up.url)

    async def prefill_reply(
        self, path: str, payload: dict[str, Any], headers: dict[str, str], route: Route | None
    ) -> dict[str, Any] | web.Response:
        """P's whole reply, a JSON object, or the error to answer."""
        started = time.perf_counter()
        opened = await self._open(self.prefill, path, payload, headers, route)
        if isinstance(opened, web.Response):
            return opened
        up, resp = opened
        try:
            raw = await resp.read()
        except UPSTREAM_ERRORS as exc:
            return self._failure_reply(self.prefill, up, exc, _REPLY)
        finally:
            resp.close()
            self._release(self.prefill, up)
        self.metrics.prefill_seconds.observe(time.perf_counter() - started)
        try:
            reply = msgspec.json.decode(raw)
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            self.metrics.errors.labels("prefill", "bad_reply").inc()
            return json_error(
                502, f"prefill endpoint {up.url} sent a reply that is not a JSON object"
            )
        if route is not None and route.on_reply is not None:
            route.on_reply(up, reply)
        return reply

    def kv_of(self, reply: dict[str, Any]) -> dict[str, Any] | None:
        """Where P left the KV; ``None`` (counted) when P did not say, and D recomputes.
        A P that stopped on its one token holds nothing, and that is not a misconfiguration."""
        kv = reply.get("kv_transfer_params")
        if isinstance(kv, dict):
            return kv
        choices = reply.get("choices")
        finish = choices[0].get("finish_reason") if isinstance(choices, list) and choices else None
        if finish in (None, "length"):
            self.metrics.prefill_without_kv.inc()
        return None

    async def prefill_leg(
        self, path: str, payload: dict[str, Any], headers: dict[str, str], route: Route | None
    ) -> dict[str, Any] | web.Response | None:
        reply = await self.prefill_reply(path, payload, headers, route)
        return reply if isinstance(reply, web.Response) else self.kv_of(reply)

    async def spliced_stream(
        self,
        request: web.Request,
        path: str,
        payload: dict[str, Any] | None,
        headers: dict[str, str],
        splice: Splice,
        prefill_s: float,
    ) -> web.StreamResponse:
        """P's token goes out at once; then D's continuation (``payload``; ``None``: P's
        token ended the answer), through ``splice``.  From here on a failure of D can
        only be an SSE error event: the 200 went out with P's token."""
        out = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Request-Id": headers["X-Request-Id"],
                "Server-Timing": f"prefill;dur={prefill_s * 1000:.1f}",
            }
        )
        await out.prepare(request)
        try:
            await out.write(splice.head(ends=payload is None))
        except ConnectionResetError:
            self.metrics.errors.labels("client", "disconnect").inc()
            request[STATUS_KEY] = 499
            return out
        if payload is not None:
            await self._continue(request, out, path, payload, headers, splice)
            if request.get(STATUS_KEY) is not None:
                return out
        await out.write_eof()
        return out

    async def _continue(
        self,
        request: web.Request,
        out: web.StreamResponse,
        path: str,
        payload: dict[str, Any],
        headers: dict[str, str],
        splice: Splice,
    ) -> None:
        started = time.perf_counter()
        opened = await self._open(self.decode, path, payload, headers, None)
        if isinstance(opened, web.Response):
            status, message = opened.status, _message_of(opened)
            await self._end_with_error(request, out, status, message)
            return
        up, resp = opened
        try:
            async for chunk in resp.content.iter_any():
                data = splice.feed(chunk)
                while splice.wants is not None:  # D's first text after a split first token
                    ids, seen = splice.wants
                    text = await self.mend(up.url, payload, splice.first, ids, seen, headers)
                    data += splice.mend(text)
                if data:
                    await out.write(data)
                if splice.done:
                    break  # a straddling stop string ended it: closing D aborts the rest
        except ConnectionResetError:
            self.metrics.errors.labels("client", "disconnect").inc()
            request[STATUS_KEY] = 499
        except UPSTREAM_ERRORS as exc:
            status, message = self._failed(self.decode, up, exc, _STREAM)
            await self._end_with_error(request, out, status, message)
        finally:
            resp.close()
            self._release(self.decode, up)
            self.metrics.decode_seconds.observe(time.perf_counter() - started)

    async def decode_whole(
        self, path: str, payload: dict[str, Any], headers: dict[str, str], first: FirstToken
    ) -> tuple[dict[str, Any], str | None] | web.Response:
        """D's whole reply as a JSON object, with its whole text mended after a split first
        token (else None), or the error to answer."""
        started = time.perf_counter()
        opened = await self._open(self.decode, path, payload, headers, None)
        if isinstance(opened, web.Response):
            return opened
        up, resp = opened
        try:
            raw = await self._read(up, resp, whole=True)
        finally:
            resp.close()
            self._release(self.decode, up)
            self.metrics.decode_seconds.observe(time.perf_counter() - started)
        if isinstance(raw, web.Response):
            return raw
        try:
            reply = msgspec.json.decode(raw)
        except ValueError:
            reply = None
        if not isinstance(reply, dict) or not reply.get("choices"):
            self.metrics.errors.labels("decode", "bad_reply").inc()
            return json_error(502, f"decode endpoint {up.url} sent a reply without choices")
        if not first.split:
            return reply, None
        choice = reply["choices"][0]
        seen = (
            choice.get("text") if "text" in choice else (choice.get("message") or {}).get("content")
        )
        ids = [*first.token_ids, *(choice.get("token_ids") or [])]
        return reply, await self.mend(up.url, payload, first, ids, seen or "", headers)

    async def mend(
        self,
        url: str,
        payload: dict[str, Any],
        first: FirstToken,
        ids: list[int],
        seen: str,
        headers: dict[str, str],
    ) -> str:
        """D's text ``seen`` as a plain instance gives it, after a split first token: the
        answer's tokens ``ids`` detokenized by the instance at ``url`` (its ``/detokenize``),
        checked against ``seen`` (:func:`~kvpool.proxy.first_token.mended_text`)."""
        model = payload.get("model")
        tail = await self._detokenize(url, model, ids, headers)
        text = mended_text(seen, tail)
        if text is None:
            prompt = await self._detokenize(url, model, first.prompt_token_ids, headers)
            if prompt is not None:
                text = mended_text(seen, tail, prompt)
        if text is None:
            # D's text may begin with the whole prompt's: never send it as it came
            self.metrics.errors.labels("decode", "unmended").inc()
            log.warning("could not mend the first text of a split first token from %s", url)
            text = tail or ""
        return text

    async def _detokenize(
        self, url: str, model: Any, ids: list[int], headers: dict[str, str]
    ) -> str | None:
        ask = {"model": model, "tokens": ids}
        try:
            async with self.session.post(
                url + "/detokenize",
                json=ask,
                headers={k: v for k, v in headers.items() if k != "Content-Type"},
            ) as reply:
                if reply.status != 200:
                    return None
                text = (await reply.json()).get("prompt")
        except (*UPSTREAM_ERRORS, ValueError):
            return None
        return text if isinstance(text, str) else None

    async def decode_leg(
        self,
        request: web.Request,
        path: str,
        payload: dict[str, Any],
        headers: dict[str, str],
        stream: bool,
        prefill_s: float = 0.0,
    ) -> web.StreamResponse:
        started = time.perf_counter()
        opened = await self._open(self.decode, path, payload, headers, None)
        if isinstance(opened, web.Response):
            return opened
        up, resp = opened
        timing = _Timing(prefill_s, started)
        try:
            if not stream:
                return await self._relay_whole(up, resp, timing)
            return await self._relay_stream(request, up, resp, headers["X-Request-Id"], timing)
        finally:
            # closing (not releasing) an unfinished reply drops the connection, which is
            # how vLLM learns that the client is gone and aborts the request
            resp.close()
            self._release(self.decode, up)
            self.metrics.decode_seconds.observe(time.perf_counter() - started)

    async def _read(
        self, up: Upstream, resp: aiohttp.ClientResponse, whole: bool
    ) -> bytes | web.Response:
        """D's whole reply, or its first bytes; a failure here is still a proper HTTP error."""
        try:
            return await (resp.read() if whole else resp.content.readany())
        except UPSTREAM_ERRORS as exc:
            return self._failure_reply(self.decode, up, exc, _REPLY)

    async def _relay_whole(
        self, up: Upstream, resp: aiohttp.ClientResponse, timing: _Timing
    ) -> web.Response:
        raw = await self._read(up, resp, whole=True)
        if isinstance(raw, web.Response):
            return raw
        content_type = resp.headers.get("Content-Type", "application/json")
        return web.Response(
            body=raw, headers={"Content-Type": content_type, "Server-Timing": timing.header()}
        )

    async def _relay_stream(
        self,
        request: web.Request,
        up: Upstream,
        resp: aiohttp.ClientResponse,
        request_id: str,
        timing: _Timing,
    ) -> web.StreamResponse:
        # The 200 goes out with D's first bytes, not before: until then a failure of D can
        # still reach the client as a proper HTTP error instead of an event in a stream.
        first = await self._read(up, resp, whole=False)
        if isinstance(first, web.Response):
            return first
        out = web.StreamResponse(
            headers={
                "Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
                "Cache-Control": "no-cache",
                "X-Request-Id": request_id,
                "Server-Timing": timing.header(),
            }
        )
        await out.prepare(request)
        try:
            await out.write(first)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
        except ConnectionResetError:
            # the client went away between two chunks (when cancellation did not get there
            # first); the finally of _decode_leg closes D's reply
            self.metrics.errors.labels("client", "disconnect").inc()
            request[STATUS_KEY] = 499
            return out
        except UPSTREAM_ERRORS as exc:
            status, message = self._failed(self.decode, up, exc, _STREAM)
            return await self._end_with_error(request, out, status, message)
        await out.write_eof()
        return out

    async def _end_with_error(
        self, request: web.Request, out: web.StreamResponse, status: int, message: str
    ) -> web.StreamResponse:
        request[STATUS_KEY] = status
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

    def _failed(
        self, group: UpstreamGroup, up: Upstream, exc: BaseException, step: _Step
    ) -> tuple[int, str]:
        """The one mapping of an upstream failure: count it, take the endpoint out, and
        return the status and message to answer (504 on a timeout, 502 otherwise)."""
        where = f"{group.role} endpoint {up.url}"
        if isinstance(exc, TIMEOUT_ERRORS):
            status, kind, message = 504, "timeout", f"{where} {step.timed_out}"
        else:
            status, kind, message = 502, step.kind, f"{where} {step.broke}: {exc!r}"
        self._fail(group, up, kind, message)
        return status, message

    def _failure_reply(
        self, group: UpstreamGroup, up: Upstream, exc: BaseException, step: _Step
    ) -> web.Response:
        """:meth:`_failed` as the HTTP error a client gets before any byte of the answer."""
        status, message = self._failed(group, up, exc, step)
        return json_error(status, message, upstream=up.url)

    def _fail(self, group: UpstreamGroup, up: Upstream, kind: str, reason: str) -> None:
        """Count the failure and take the endpoint out until its /health answers again."""
        self.metrics.errors.labels(group.role, kind).inc()
        if group.mark_down(up.url, reason):
            self.metrics.upstream_healthy.labels(group.role, up.url).set(0)
            log.warning("%s endpoint %s out of rotation: %s", group.role, up.url, reason)
