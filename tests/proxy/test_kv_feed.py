"""kv_aware's feed: vLLM's event streams in (replay, restart, malformed), feedback out."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvpool.errors import ConfigError
from kvpool.protocol.kv_events import BlockStored, KVEventBatch, encode_batch
from kvpool.proxy.block_index import BlockIndex, content_keys
from kvpool.proxy.kv_feed import EventSource, KvFeed, Sequencer, parse_event_source
from kvpool.proxy.metrics import ProxyMetrics
from kvpool.proxy.routing import Upstream
from kvpool.testing import lifetime
from tests.proxy.harness import REPO, run

URL = "http://127.0.0.1:1"


def batch(*events: Any) -> bytes:
    return encode_batch(KVEventBatch(ts=1.0, events=list(events)))


def stored(h: bytes, tokens: list[int], parent: bytes | None = None, medium: str = "GPU") -> Any:
    return BlockStored(
        block_hashes=[h],
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=4,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def feed(clock: Clock | None = None) -> tuple[KvFeed, Upstream, BlockIndex, ProxyMetrics]:
    up = Upstream(URL)
    pool = BlockIndex()
    metrics = ProxyMetrics()
    f = KvFeed(
        [EventSource(URL, "ipc:///nowhere")],
        {URL: up},
        pool,
        metrics,
        distrust_s=10,
        clock=clock or Clock(),
    )
    return f, up, pool, metrics


def test_a_streams_numbers_say_next_gap_or_restart() -> None:
    seq = Sequencer()
    assert [seq.see(n) for n in (0, 1, 2)] == ["next"] * 3
    assert seq.see(5) == "gap" and seq.last == 2  # filled by the caller first
    assert seq.see(3) == "next"
    assert seq.see(0) == "restart"
    late = Sequencer()
    assert late.see(7) == "gap"  # joining late: what came before is in the replay buffer


def test_own_and_pool_events_go_to_their_indexes() -> None:
    f, up, pool, _ = feed()
    assert (
        f.apply(URL, 0, batch(stored(b"a", [1, 2, 3, 4]), stored(b"k", [1, 2, 3, 4], medium="CPU")))
        == "applied"
    )
    assert up.blocks is not None and len(up.blocks) == 1 and len(pool) == 1


def test_a_malformed_message_is_counted_and_the_stream_goes_on() -> None:
    f, up, _, metrics = feed()
    assert f.apply(URL, 0, b"\x93not msgpack of a batch") == "malformed"
    assert f.apply(URL, 1, batch(stored(b"a", [1, 2, 3]))) == "malformed"  # 3 tokens, block 4
    assert f.apply(URL, 2, batch(stored(b"a", [1, 2, 3, 4]))) == "applied"
    assert metrics.kv_events_malformed.labels(URL)._value.get() == 2
    assert up.blocks is not None and len(up.blocks) == 1


def test_a_restarted_instance_starts_afresh() -> None:
    f, up, _, _ = feed()
    f.apply(URL, 0, batch(stored(b"a", [1, 2, 3, 4])))
    f.apply(URL, 1, batch(stored(b"b", [5, 6, 7, 8], parent=b"a")))
    assert f.apply(URL, 0, batch(stored(b"c", [9, 9, 9, 9]))) == "restart"
    assert up.blocks is not None and len(up.blocks) == 1  # only what the new one said


def test_an_instance_that_hits_less_than_its_events_said_is_routed_by_load() -> None:
    clock = Clock()
    f, up, pool, metrics = feed(clock)
    tokens = list(range(16))
    keys = content_keys(tokens, 4)
    f.apply(URL, 0, batch(stored(b"a", tokens[:4]), stored(b"b", tokens[4:8], parent=b"a")))
    # it said 2 blocks, it hit none: lying, stopped or lagging, it is not trusted
    f.observe(URL, (2, 0), keys, 4, cached_tokens=0)
    assert not up.trusted and up.blocks is not None and len(up.blocks) == 0
    assert metrics.mispredictions.labels(URL)._value.get() == 1
    f.refresh_trust()
    assert not up.trusted
    clock.now += 11  # distrust_s later it is trusted again, from an empty index
    f.refresh_trust()
    assert up.trusted
    # a right prediction changes nothing
    f.apply(URL, 1, batch(stored(b"c", tokens[:4])))
    f.observe(URL, (1, 0), keys, 4, cached_tokens=4)
    assert up.trusted and len(up.blocks) == 1
    # the pool predicted more than it gave: its blocks past the real hit are forgotten
    f.apply(URL, 2, batch(*(stored(bytes([i]), tokens[4 * i : 4 * i + 4],
                                   parent=bytes([i - 1]) if i else None, medium="CPU")
                            for i in range(4))))  # fmt: skip
    assert pool.prefix(keys) == 4
    f.observe(URL, (1, 4), keys, 4, cached_tokens=4)
    assert pool.prefix(keys) == 1 and up.trusted  # its own prediction was right


def test_the_flag_names_the_instance_and_its_endpoints() -> None:
    source = parse_event_source("http://10.0.0.1:8100/=tcp://10.0.0.1:5557,tcp://10.0.0.1:5558")
    assert source == EventSource(
        "http://10.0.0.1:8100", "tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558"
    )
    assert parse_event_source("http://h:1=ipc:///x").replay is None
    for bad in ("tcp://only-an-endpoint", "http://h:1=", "http://h=a,b,c"):
        with pytest.raises(ConfigError, match="URL=ZMQ_ENDPOINT"):
            parse_event_source(bad)


# ------------------------------------------------------------------ vLLM's own publisher


class Publisher:
    """vLLM's ZmqEventPublisher in a process of its own (tests.proxy.vllm_publisher)."""

    def __init__(self, endpoint: str, replay: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_NO_USAGE_STATS": "1"}
        self.proc = lifetime.popen(
            [sys.executable, "-W", "ignore", "-m", "tests.proxy.vllm_publisher", endpoint, replay],
            cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.expect("READY")

    def expect(self, word: str) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith(word), line

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        self.expect("SENT")

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=30)
        self.proc.stdin.close()
        self.proc.stdout.close()


@pytest.mark.slow
def test_a_late_subscriber_replays_what_it_missed_and_a_restart_resets(tmp_path: Path) -> None:
    endpoint, replay = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    tokens = list(range(16))
    lines = [
        f"store b{i} {f'b{i - 1}' if i else '-'} {' '.join(map(str, tokens[4 * i : 4 * i + 4]))}"
        for i in range(4)
    ]
    up = Upstream(URL)
    metrics = ProxyMetrics()
    f = KvFeed([EventSource(URL, endpoint, replay)], {URL: up}, BlockIndex(), metrics)

    async def scenario() -> None:
        publisher = Publisher(endpoint, replay)
        try:
            for line in lines[:3]:  # before the proxy listens
                publisher.send(line)
            async with aiohttp.ClientSession() as session:
                await f.start(session)
                await asyncio.sleep(0.5)  # the subscription is in place
                publisher.send(lines[3])  # seq 3: batches 0-2 come from the replay socket
                assert up.blocks is not None
                for _ in range(100):
                    if up.blocks.prefix(content_keys(tokens, 4)) == 4:
                        break
                    await asyncio.sleep(0.05)
                assert up.blocks.prefix(content_keys(tokens, 4)) == 4
                publisher.close()
                restarted = Publisher(endpoint, replay)  # a new process: seq from 0 again
                try:
                    await asyncio.sleep(0.5)
                    restarted.send("store z - 7 7 7 7")
                    for _ in range(100):
                        if len(up.blocks) == 1:
                            break
                        await asyncio.sleep(0.05)
                    assert len(up.blocks) == 1 and up.blocks.prefix(content_keys(tokens, 4)) == 0
                finally:
                    restarted.close()
                await f.stop()
        finally:
            publisher.close()

    run(scenario(), timeout=120)
    assert metrics.kv_index_resets.labels(URL)._value.get() >= 1
