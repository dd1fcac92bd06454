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

__all__ = ["REPO", "Stack", "StubProcess", "parse_sse", "proxy_stack", "read_sse", "run"]

REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
    """Run one scenario; every scenario is bounded in time."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


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
