"""Endpoints leave rotation when they die or fail /health, and come back when it recovers."""

from __future__ import annotations

import asyncio

import aiohttp

from kvpool.proxy import ProxyConfig, ProxyServer
from tests.proxy.harness import StubProcess, proxy_stack, read_sse, run, streamed
from tests.proxy.stub_upstream import StubUpstream, reference_text
from tests.waiting import async_wait_until


def test_failing_health_poll_takes_endpoint_out_and_recovery_puts_it_back() -> None:
    async def scenario() -> None:
        async with proxy_stack(n_decode=2, health_interval_s=0.05) as stack:
            sick, well = stack.decodes
            group = stack.proxy.decode
            sick.healthy = False  # its /health now answers 503
            await async_wait_until(lambda: not group.get(sick.url).healthy)
            assert "503" in group.get(sick.url).last_error
            body = {"prompt": "hello", "max_tokens": 3}
            for _ in range(4):
                async with stack.session.post(stack.url + "/v1/completions", json=body) as r:
                    assert r.status == 200
            assert len(sick.received) == 0 and len(well.received) == 4
            sick.healthy = True
            await async_wait_until(lambda: group.get(sick.url).healthy)
            for _ in range(4):
                async with stack.session.post(stack.url + "/v1/completions", json=body) as r:
                    assert r.status == 200
            assert len(sick.received) > 0

    run(scenario())


def test_decode_killed_mid_stream_fails_that_request_and_the_rest_go_on() -> None:
    async def scenario() -> None:
        d0 = StubProcess("d0", token_delay_s=0.05)
        d1 = StubProcess("d1", token_delay_s=0.0)
        p0 = StubUpstream(name="p0")
        proxy: ProxyServer | None = None
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        try:
            await asyncio.gather(d0.start(), d1.start(), p0.start())
            proxy = ProxyServer(
                ProxyConfig(
                    prefill=(p0.url,),
                    decode=(d0.url, d1.url),
                    port=0,
                    policy="round_robin",
                    health_interval_s=0.1,
                )
            )
            await proxy.start()
            # round robin: the first request lands on d0, which streams slowly
            body = {"prompt": "a long answer", "max_tokens": 200, "stream": True}
            resp = await session.post(proxy.url + "/v1/completions", json=body)
            assert resp.status == 200
            await resp.content.readuntil(b"\n\n")
            assert proxy.decode.get(d0.url).inflight == 1
            await d0.kill()
            _, done, events = await read_sse(resp)
            resp.close()
            assert not done
            assert events[-1]["error"]["code"] == 502
            assert d0.url in events[-1]["error"]["message"]
            assert not proxy.decode.get(d0.url).healthy
            # later requests are served by the remaining decode, all of them correct
            short = {"prompt": "next", "max_tokens": 4}
            for _ in range(6):
                assert await streamed(session, proxy.url, short) == reference_text(short)
            # d0 comes back on the same port; its /health brings it back into rotation
            d0 = StubProcess("d0", port=d0.port)
            await d0.start()
            await async_wait_until(lambda: proxy is not None and proxy.decode.get(d0.url).healthy)
            for _ in range(4):
                assert await streamed(session, proxy.url, short) == reference_text(short)
            async with session.get(d0.url + "/_stub/received") as r:
                assert len((await r.json())["received"]) >= 1
        finally:
            await session.close()
            if proxy is not None:
                await proxy.stop()
            await asyncio.gather(d0.kill(), d1.kill(), p0.stop())

    run(scenario(), timeout=90)
