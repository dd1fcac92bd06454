"""The one upstream-failure mapping of the proxy's legs: status, message, metric, rotation.

Every step (sending, reading a whole reply, relaying a stream) goes through it; the
stub-upstream tests in ``test_server.py`` and ``test_health.py`` drive it end to end."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from kvpool.proxy.legs import _REPLY, _SEND, _STREAM, Legs, _Step
from kvpool.proxy.metrics import ProxyMetrics
from kvpool.proxy.routing import RoundRobin, UpstreamGroup

URL = "http://127.0.0.1:1"


def legs() -> tuple[Legs, UpstreamGroup, ProxyMetrics]:
    prefill = UpstreamGroup("prefill", [URL], RoundRobin())
    decode = UpstreamGroup("decode", [URL], RoundRobin())
    metrics = ProxyMetrics()
    session: Any = None  # never used: the mapping does no I/O
    return Legs(session, prefill, decode, metrics), decode, metrics


BROKEN = aiohttp.ServerDisconnectedError()


@pytest.mark.parametrize(
    ("step", "exc", "status", "message", "kind"),
    [
        (_SEND, TimeoutError(), 504, f"decode endpoint {URL} timed out", "timeout"),
        (_SEND, aiohttp.ServerTimeoutError(), 504, f"decode endpoint {URL} timed out", "timeout"),
        (_SEND, BROKEN, 502, f"decode endpoint {URL} failed: {BROKEN!r}", "disconnect"),
        (_REPLY, TimeoutError(), 504, f"decode endpoint {URL} timed out", "timeout"),
        (
            _REPLY,
            BROKEN,
            502,
            f"decode endpoint {URL} broke off its reply: {BROKEN!r}",
            "disconnect",
        ),
        (_STREAM, TimeoutError(), 504, f"decode endpoint {URL} timed out mid-stream", "timeout"),
        (_STREAM, BROKEN, 502, f"decode endpoint {URL} broke off the stream: {BROKEN!r}", "stream"),
    ],
)
def test_a_failure_is_answered_counted_and_takes_the_endpoint_out(
    step: _Step, exc: BaseException, status: int, message: str, kind: str
) -> None:
    leg, decode, metrics = legs()
    assert leg._failed(decode, decode.get(URL), exc, step) == (status, message)
    assert metrics.errors.labels("decode", kind)._value.get() == 1
    assert not decode.get(URL).healthy and decode.get(URL).last_error == message
    assert metrics.upstream_healthy.labels("decode", URL)._value.get() == 0


def test_the_reply_before_any_byte_is_openai_shaped_and_names_the_upstream() -> None:
    leg, decode, _ = legs()
    reply = leg._failure_reply(decode, decode.get(URL), TimeoutError(), _REPLY)
    assert reply.status == 504
    assert reply.headers["X-Kvpool-Upstream"] == URL
    assert reply.text is not None and '"timeout"' in reply.text
