"""kv_aware through the real proxy: stub instances on 127.0.0.1, their KV events on ZMQ.

Each stub stands in for a vLLM instance (tests.proxy.stub_upstream: ``/tokenize`` one
token per byte, ``/metrics``, replies with ``prompt_tokens_details``); each one's events
come from a ZMQ PUB socket the test binds, in vLLM's format (kvpool.protocol.kv_events,
checked against vLLM's own classes in tests/protocol).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import zmq
import zmq.asyncio

from kvpool.protocol.kv_events import BlockStored, KVEventBatch, encode_batch
from kvpool.proxy import ProxyConfig, ProxyServer
from kvpool.proxy.kv_feed import EventSource
from tests.proxy.harness import run
from tests.proxy.stub_upstream import StubUpstream

BS = 4
PROMPT = "a system prompt every tenant shares, then a question"


@dataclass
class Fleet:
    proxy: ProxyServer
    prefills: list[StubUpstream]
    pubs: list[Any]
    session: aiohttp.ClientSession
    seqs: list[int]

    async def publish(self, i: int, payload: bytes) -> None:
        await self.pubs[i].send_multipart([b"", self.seqs[i].to_bytes(8, "big"), payload])
        self.seqs[i] += 1

    async def holds(self, i: int, text: str) -> None:
        """Instance ``i`` says it cached every full block of ``text``'s tokens."""
        tokens = list(text.encode())
        n = len(tokens) // BS
        event = BlockStored(
            block_hashes=[f"{i}-{b}".encode() for b in range(n)],
            parent_block_hash=None,
            token_ids=tokens[: n * BS],
            block_size=BS,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )
        await self.publish(i, encode_batch(KVEventBatch(ts=1.0, events=[event])))

    async def ask(self, prompt: str) -> int:
        """Send a completion; which prefill answered it."""
        body = {"model": "m", "prompt": prompt, "max_tokens": 2}
        async with self.session.post(self.proxy.url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
        counts = [sum(1 for path, _ in p.received if "completions" in path) for p in self.prefills]
        return self._last(counts)

    def _last(self, counts: list[int]) -> int:
        changed = [i for i, (now, before) in enumerate(zip(counts, self._seen, strict=True))
                   if now > before]  # fmt: skip
        self._seen = counts
        assert len(changed) == 1, counts
        return changed[0]

    _seen: list[int] = None  # type: ignore[assignment]


@asynccontextmanager
async def fleet(tmp: Path, n: int = 3) -> AsyncIterator[Fleet]:
    ctx = zmq.asyncio.Context()
    prefills = [StubUpstream(name=f"p{i}", cached_tokens=0) for i in range(n)]
    decode = StubUpstream(name="d")
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
    pubs = []
    proxy = None
    try:
        for stub in [*prefills, decode]:
            await stub.start()
        sources = []
        for i, stub in enumerate(prefills):
            pub = ctx.socket(zmq.PUB)
            pub.bind(f"ipc://{tmp}/events-{i}")
            pubs.append(pub)
            sources.append(EventSource(stub.url, f"ipc://{tmp}/events-{i}"))
        config = ProxyConfig(
            prefill=tuple(s.url for s in prefills),
            decode=(decode.url,),
            port=0,
            policy="kv_aware",
            kv_events=tuple(sources),
        )
        proxy = ProxyServer(config)
        await proxy.start()
        await asyncio.sleep(0.3)  # the subscriptions are in place
        f = Fleet(proxy, prefills, pubs, session, [0] * n)
        f._seen = [0] * n
        yield f
    finally:
        await session.close()
        if proxy is not None:
            await proxy.stop()
        for stub in [*prefills, decode]:
            await stub.stop()
        for pub in pubs:
            pub.close(linger=0)
        ctx.term()


async def settle() -> None:
    await asyncio.sleep(0.2)  # the proxy's subscriber has applied what was published


def test_a_prompt_goes_to_the_instance_whose_cache_holds_its_prefix(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with fleet(tmp_path) as f:
            await f.holds(2, PROMPT)
            f.prefills[2].cached_tokens = len(PROMPT) // BS * BS  # its replies agree
            await settle()
            for _ in range(3):
                assert await f.ask(PROMPT + " number one") == 2
            m = await (await f.session.get(f.proxy.url + "/metrics")).text()
            url = f.prefills[2].url
            assert f'kvpool_proxy_predicted_hit_tokens_total{{instance="{url}"}}' in m

    run(scenario())


def test_an_instance_whose_events_lie_is_routed_by_load_until_they_hold(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with fleet(tmp_path, n=2) as f:
            await f.holds(0, PROMPT)  # it says so, but its replies will say 0 cached
            await settle()
            assert await f.ask(PROMPT) == 0
            # the reply showed the events wrong: 0 is not trusted, so load decides
            assert not f.proxy.prefill.upstreams[0].trusted
            f.prefills[0].waiting = 3  # busier: what it claims to hold no longer counts
            await f.holds(0, PROMPT)
            await asyncio.sleep(1.5)  # a metrics poll has seen the queue
            assert [await f.ask(PROMPT + str(i)) for i in range(3)] == [1, 1, 1]

    run(scenario())


def test_malformed_events_and_a_flood_leave_the_proxy_serving(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with fleet(tmp_path, n=2) as f:
            await f.publish(0, b"\x00garbage")
            await f.pubs[0].send_multipart([b"only", b"two frames"])
            for i in range(200):  # far more blocks than it keeps
                await f.holds(1, f"{i:04d}" * 50)
            await settle()
            assert await f.ask(PROMPT) in (0, 1)
            index = f.proxy.prefill.upstreams[1].blocks
            assert index is not None and index.hashes <= f.proxy.config.kv_max_blocks
            m = await (await f.session.get(f.proxy.url + "/metrics")).text()
            assert (
                f'kvpool_proxy_kv_events_malformed_total{{instance="{f.prefills[0].url}"}} 2.0' in m
            )

    run(scenario())
