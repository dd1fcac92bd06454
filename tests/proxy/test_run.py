"""``kvpool proxy`` as a real process: it serves, and SIGTERM/SIGINT shut it down gracefully."""

from __future__ import annotations

import asyncio
import signal
import sys

import aiohttp
import pytest

from kvpool.proxy import ProxyConfig, ProxyServer, serve
from tests.proxy.harness import REPO, parse_sse, proxy_over, run
from tests.proxy.stub_upstream import StubUpstream, reference_text


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_cli_proxy_serves_and_finishes_in_flight_stream_on_signal(sig: signal.Signals) -> None:
    async def scenario() -> None:
        p, d = StubUpstream(name="p0"), StubUpstream(name="d0", token_delay_s=0.02)
        flags = ["--policy", "prefix_affinity", "--read-timeout", "30", "--health_interval=0.5"]
        async with proxy_over(p, d, flags) as (proc, line):
            assert line.startswith("kvpool proxy listening on "), line
            url = line.split()[4]
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
                body = {"prompt": "graceful", "max_tokens": 40, "stream": True}
                async with s.post(url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    await resp.content.readuntil(b"\n\n")
                    proc.send_signal(sig)  # ~0.8 s of tokens still to come
                    rest = await resp.read()
            text, done, _ = parse_sse(rest)
            assert done
            assert reference_text(body).endswith(text)
            assert await asyncio.wait_for(proc.wait(), 20) == 0

    run(scenario())


def test_cli_proxy_rejects_bad_config_with_the_flag_named() -> None:
    async def scenario() -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvpool", "proxy", "--prefill", "nope", "--decode", "http://h:1",
            cwd=REPO, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 2
        assert b"--prefill" in err

    run(scenario())


def test_serve_in_process_stops_when_its_event_is_set() -> None:
    """How ``kvpool up`` can embed the proxy in its own event loop."""

    async def scenario() -> None:
        p, d = StubUpstream(name="p0"), StubUpstream(name="d0")
        await p.start()
        await d.start()
        ready: asyncio.Queue[ProxyServer] = asyncio.Queue()
        stop = asyncio.Event()
        cfg = ProxyConfig(prefill=(p.url,), decode=(d.url,), port=0)
        task = asyncio.create_task(serve(cfg, stop=stop, on_ready=ready.put_nowait))
        try:
            url = (await asyncio.wait_for(ready.get(), 10)).url
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
                body = {"prompt": "embedded", "max_tokens": 3}
                async with s.post(url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    assert (await resp.json())["choices"][0]["text"] == reference_text(body)
                stop.set()
                await asyncio.wait_for(task, 10)
                # stopped: the port no longer answers
                try:
                    async with s.get(url + "/health") as resp:
                        raise AssertionError(f"still serving: HTTP {resp.status}")
                except aiohttp.ClientConnectionError:
                    pass
        finally:
            if not task.done():
                task.cancel()
            await p.stop()
            await d.stop()

    run(scenario())
