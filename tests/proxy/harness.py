"""Test harness: a proxy in front of stub upstreams, all on real 127.0.0.1 sockets."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from kvpool.proxy import ProxyConfig, ProxyServer
from tests.proxy.stub_upstream import StubUpstream

__all__ = [
    "REPO",
    "Stack",
    "StubProcess",
    "parse_sse",
    "proxy_over",
    "proxy_process",
    "proxy_stack",
    "read_sse",
    "run",
    "streamed",
]

REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
    """Run one scenario; every scenario is bounded in time."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def proxy_process(
    args: list[str], env: dict[str, str]
) -> tuple[asyncio.subprocess.Process, str]:
    """``kvpool proxy --port 0 ARGS`` as a child process, and the first line it printed
    (``kvpool proxy listening on URL …``; empty when it stopped without listening)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvpool", "proxy", "--port", "0", *args,
        cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
    )  # fmt: skip
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
    return proc, line


@asynccontextmanager
async def proxy_over(
    p: StubUpstream, d: StubUpstream, args: list[str], env: dict[str, str] | None = None
) -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    """The stubs ``p`` and ``d`` started, and a :func:`proxy_process` in front of them with
    ``args`` added; on the way out a proxy still running is killed, and the stubs stop."""
    await p.start()
    await d.start()
    proc: asyncio.subprocess.Process | None = None
    try:
        proc, line = await proxy_process(["--prefill", p.url, "--decode", d.url, *args], env or {})
        yield proc, line
    finally:
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()
        await p.stop()
        await d.stop()


@dataclass
class Stack:
    proxy: ProxyServer
    prefills: list[StubUpstream]
    decodes: list[StubUpstream]
    session: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return self.proxy.url


@asynccontextmanager
async def proxy_stack(
    n_prefill: int = 1,
    n_decode: int = 1,
    token_delay_s: float = 0.0,
    extra_decode: tuple[str, ...] = (),
    stub_api_key: str | None = None,
    **config: Any,
) -> AsyncIterator[Stack]:
    """``stub_api_key``: the stubs demand it on /v1/*, as `vllm serve --api-key` does."""
    prefills = [StubUpstream(name=f"p{i}", api_key=stub_api_key) for i in range(n_prefill)]
    decodes = [
        StubUpstream(name=f"d{i}", token_delay_s=token_delay_s, api_key=stub_api_key)
        for i in range(n_decode)
    ]
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
    proxy: ProxyServer | None = None
    try:
        for stub in prefills + decodes:
            await stub.start()
        cfg = ProxyConfig(
            prefill=tuple(s.url for s in prefills),
            decode=tuple(s.url for s in decodes) + extra_decode,
            port=0,
            **config,
        )
        proxy = ProxyServer(cfg)
        await proxy.start()
        yield Stack(proxy, prefills, decodes, session)
    finally:
        await session.close()
        if proxy is not None:
            await proxy.stop()
        for stub in prefills + decodes:
            await stub.stop()


async def read_sse(resp: aiohttp.ClientResponse) -> tuple[str, bool, list[dict[str, Any]]]:
    """(joined text, saw [DONE], parsed events) of an OpenAI SSE stream."""
    return parse_sse(await resp.read())


async def streamed(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> str:
    """``body`` streamed from ``url``'s /v1/completions: the text, once ``[DONE]`` came."""
    async with session.post(url + "/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status == 200
        text, done, _ = await read_sse(resp)
        assert done
        return text


def parse_sse(raw: bytes) -> tuple[str, bool, list[dict[str, Any]]]:
    text: list[str] = []
    events: list[dict[str, Any]] = []
    done = False
    for block in raw.decode().split("\n\n"):
        if not block.startswith("data: "):
            continue
        data = block[len("data: ") :]
        if data == "[DONE]":
            done = True
            continue
        event = json.loads(data)
        events.append(event)
        for choice in event.get("choices", []):
            piece = choice.get("text")
            if piece is None:
                piece = choice.get("delta", {}).get("content")
            text.append(piece or "")
    return "".join(text), done, events


class StubProcess:
    """A stub upstream in its own process, so that a test can kill it outright."""

    def __init__(self, name: str, port: int = 0, token_delay_s: float = 0.0) -> None:
        self.name = name
        self.port = port
        self.token_delay_s = token_delay_s
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, timeout: float = 20.0) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.proxy.stub_upstream",
            "--port",
            str(self.port),
            "--name",
            self.name,
            "--token-delay",
            str(self.token_delay_s),
            cwd=REPO,
            stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not line.startswith(b"PORT "):
            await self.kill()
            raise RuntimeError(f"stub {self.name} did not start: {line!r}")
        self.port = int(line.split()[1])

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)
            await asyncio.wait_for(self.proc.wait(), 10)
        self.proc = None
