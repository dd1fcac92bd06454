"""What the proxy knows of each instance for ``kv_aware`` routing, and how it learns it.

Each instance's KV events over ZMQ (a subscriber per instance, replaying gaps and starting
afresh when the instance restarts), its load from ``/metrics``, and feedback: what its
reply says it hit against what the index predicted (the rules are on :class:`KvFeed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvpool.errors import ConfigError
from kvpool.protocol.kv_events import (
    END_SEQ,
    MEDIUM_GPU,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
)
from kvpool.proxy.block_index import BlockIndex
from kvpool.proxy.metrics import ProxyMetrics
from kvpool.proxy.routing import Upstream

__all__ = ["EventSource", "KvFeed", "Sequencer", "parse_event_source"]

logger = logging.getLogger("kvpool.proxy")
_REPLAY_TIMEOUT_S = 2.0
_LOG_EVERY_S = 30.0


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where an instance publishes its KV events: ``endpoint`` (vLLM's PUB socket, to
    connect to) and ``replay`` (its ROUTER socket for missed batches, optional)."""

    url: str
    endpoint: str
    replay: str | None = None


def parse_event_source(text: str) -> EventSource:
    """``URL=ENDPOINT[,REPLAY]``, as ``kvpool proxy --kv-events`` takes it."""
    url, sep, rest = text.partition("=")
    endpoints = [e.strip() for e in rest.split(",")]
    if not sep or not url.strip() or not endpoints[0] or len(endpoints) > 2:
        raise ConfigError(
            f"--kv-events {text!r}: expected INSTANCE_URL=ZMQ_ENDPOINT[,REPLAY_ENDPOINT],"
            " e.g. http://10.0.0.1:8100=tcp://10.0.0.1:5557,tcp://10.0.0.1:5558"
        )
    replay = endpoints[1] if len(endpoints) > 1 and endpoints[1] else None
    return EventSource(url.strip().rstrip("/"), endpoints[0], replay)


# vLLM numbers an instance's batches 0, 1, 2, ... from its start: a seq at or below the
# last one seen is a restarted publisher (its cache is empty again); a jump is a gap,
# which its replay socket may still hold.  Joining a stream late is a gap from 0: what the
# instance cached before the proxy started is in its replay buffer too.
class Sequencer:
    """What a batch's seq means: ``"next"``, ``"gap"`` (batches were missed) or
    ``"restart"``."""

    def __init__(self) -> None:
        self.last = -1

    def see(self, seq: int) -> str:
        """A gap leaves ``last`` where it was: the caller fills it, then :meth:`KvFeed.resync`."""
        last = self.last
        if seq > last + 1:
            return "gap"
        self.last = seq
        return "next" if seq == last + 1 else "restart"


# Rules:
# - An instance's own cache is what its events say with medium GPU (vLLM's name, on CPU
#   too) or none; any other medium (kvpool's store connector says CPU) is the shared pool.
# - A gap is filled from the replay socket when there is one and it still holds the
#   batches; else the instance's index starts afresh (a stale index routes worse than an
#   empty one).  A restart or an unhealthy instance starts afresh too.
# - A malformed message is counted and dropped; the stream goes on.
# - Feedback: when an instance's reply shows fewer cached tokens than the prediction it
#   was routed on, by more than a block: if its own cache was predicted, its events are
#   not trusted (the stream stopped, lags, or says what is not so) for distrust_s and its
#   index starts afresh; if the pool was, the pool's blocks past the real hit are
#   forgotten.  Until then it is routed by load alone.
class KvFeed:
    """Feeds the ``kv_aware`` policy: instances' indexes, the pool's, their load."""

    def __init__(
        self,
        sources: Sequence[EventSource],
        upstreams: Mapping[str, Upstream],
        pool: BlockIndex,
        metrics: ProxyMetrics,
        *,
        max_blocks: int = 200_000,
        metrics_interval_s: float = 1.0,
        distrust_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # an instance with several DP engines publishes one stream per engine: the
        # instance's index is what they hold together
        self.sources = list(sources)
        unknown = sorted({s.url for s in sources} - set(upstreams))
        if unknown:
            raise ValueError(f"--kv-events names {unknown}, which are not --prefill endpoints")
        self.upstreams = upstreams
        self.pool = pool
        self.metrics = metrics
        self.metrics_interval_s = metrics_interval_s
        self.distrust_s = distrust_s
        self._clock = clock
        self._sequencers = {(s.url, s.endpoint): Sequencer() for s in sources}
        self._distrusted_until: dict[str, float] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._last_log = -_LOG_EVERY_S
        for source in sources:
            if upstreams[source.url].blocks is None:
                upstreams[source.url].blocks = BlockIndex(max_blocks)

    # -- what the events say ---------------------------------------------------------

    def apply(self, url: str, seq: int, payload: bytes, endpoint: str | None = None) -> str:
        """One message of ``url``'s stream (``endpoint``: which of its streams, when it
        has several): ``"applied"``, ``"gap"`` (the caller fills it first, then calls
        again), ``"restart"`` (applied after a reset) or ``"malformed"``."""
        up = self.upstreams[url]
        seen = self._sequencer(url, endpoint).see(seq)
        if seen == "gap":
            return "gap"
        if seen == "restart":
            self.reset(url, "its event stream restarted")
        try:
            batch = decode_batch(payload)
            self._apply_batch(up, batch)
        except (ValueError, TypeError) as exc:
            self.metrics.kv_events_malformed.labels(url).inc()
            self._warn(f"malformed KV events from {url} dropped: {exc}")
            return "malformed"
        self.metrics.kv_events.labels(url).inc(len(batch.events))
        assert up.blocks is not None
        self.metrics.kv_index_blocks.labels(url).set(len(up.blocks))
        self.metrics.kv_index_blocks.labels("pool").set(len(self.pool))
        return "restart" if seen == "restart" else "applied"

    def _apply_batch(self, up: Upstream, batch: KVEventBatch) -> None:
        own = [e for e in batch.events if _own(e)]
        pooled = [e for e in batch.events if not _own(e)]
        assert up.blocks is not None
        up.blocks.apply(own)
        self.pool.apply(pooled)

    def _sequencer(self, url: str, endpoint: str | None) -> Sequencer:
        if endpoint is None:
            endpoint = next(s.endpoint for s in self.sources if s.url == url)
        return self._sequencers[(url, endpoint)]

    def resync(self, url: str, seq: int, endpoint: str | None = None) -> None:
        """After a gap was filled from the replay socket: go on from ``seq``."""
        self._sequencer(url, endpoint).last = seq

    def reset(self, url: str, why: str) -> None:
        up = self.upstreams[url]
        if up.blocks is not None and len(up.blocks):
            logger.info("kv_aware: %s's index starts afresh: %s", url, why)
        if up.blocks is not None:
            up.blocks.clear()
        self.metrics.kv_index_resets.labels(url).inc()

    # -- what the replies say --------------------------------------------------------

    def refresh_trust(self) -> None:
        now = self._clock()
        for url, until in list(self._distrusted_until.items()):
            if now >= until:
                del self._distrusted_until[url]
                self.upstreams[url].trusted = True
                self.metrics.kv_trusted.labels(url).set(1)

    def observe(
        self,
        url: str,
        predicted: tuple[int, int],
        keys: Sequence[bytes],
        block_size: int,
        cached_tokens: int | None,
    ) -> None:
        """The chosen instance answered: ``predicted`` (own, pool) hit in blocks against
        the ``cached_tokens`` its reply reports (None: it reports none)."""
        own, pooled = predicted
        self.metrics.predicted_hit_tokens.labels(url).inc(max(own, pooled) * block_size)
        if cached_tokens is None:
            return
        self.metrics.actual_hit_tokens.labels(url).inc(cached_tokens)
        actual = cached_tokens // block_size
        if actual + 1 >= max(own, pooled):
            return
        self.metrics.mispredictions.labels(url).inc()
        if own > actual + 1 and self.upstreams[url].blocks is not None:
            self._distrusted_until[url] = self._clock() + self.distrust_s
            self.upstreams[url].trusted = False
            self.metrics.kv_trusted.labels(url).set(0)
            self.reset(url, f"it hit {cached_tokens} tokens where its events said {own} blocks")
        if pooled > actual + 1:
            self.pool.forget(keys[actual:pooled])

    # -- the I/O ---------------------------------------------------------------------

    async def start(self, session: aiohttp.ClientSession) -> None:
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        for source in self.sources:
            self.metrics.kv_trusted.labels(source.url).set(1)
            self._tasks.append(asyncio.create_task(self._subscribe(source)))
        for url in self.upstreams:
            self._tasks.append(asyncio.create_task(self._poll_metrics(session, url)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        ctx = getattr(self, "_ctx", None)
        if ctx is not None:
            ctx.destroy(linger=0)

    async def _subscribe(self, source: EventSource) -> None:
        import zmq

        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(source.endpoint)
        try:
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.metrics.kv_events_malformed.labels(source.url).inc()
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if self.apply(source.url, seq, frames[2], source.endpoint) == "gap":
                    await self._fill_gap(source, seq, frames[2])
        finally:
            sub.close(linger=0)

    async def _fill_gap(self, source: EventSource, seq: int, payload: bytes) -> None:
        """Batches were missed before ``seq``: replay them, else start afresh."""
        since = self._sequencer(source.url, source.endpoint).last + 1
        filled = False
        if source.replay is not None:
            filled = await self._replay(source, since, seq)
        if not filled:
            self.reset(source.url, "it missed KV events its replay socket could not give")
        self.resync(source.url, seq - 1, source.endpoint)
        self.apply(source.url, seq, payload, source.endpoint)

    async def _replay(self, source: EventSource, since: int, until: int) -> bool:
        """Ask ``source``'s replay socket for batches from ``since`` up to ``until``
        (exclusive); whether it gave them all."""
        import zmq

        assert source.replay is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(source.replay)
        expected = since
        try:
            await dealer.send_multipart([b"", since.to_bytes(8, "big")])
            deadline = self._clock() + _REPLAY_TIMEOUT_S
            while self._clock() < deadline:
                if not await dealer.poll(timeout=int(_REPLAY_TIMEOUT_S * 1000)):
                    return False
                frames = await dealer.recv_multipart()
                if len(frames) != 4 or frames[2] == END_SEQ:
                    return expected >= until
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq != expected or seq >= until:
                    continue  # before what is wanted, or already live
                self.resync(source.url, seq - 1, source.endpoint)
                self.apply(source.url, seq, frames[3], source.endpoint)
                expected += 1
            return False
        finally:
            dealer.close(linger=0)

    async def _poll_metrics(self, session: aiohttp.ClientSession, url: str) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        up = self.upstreams[url]
        while True:
            try:
                async with session.get(
                    url + "/metrics", timeout=aiohttp.ClientTimeout(total=2)
                ) as reply:
                    text = await reply.text()
                values: dict[str, float] = {}
                for family in text_string_to_metric_families(text):
                    for sample in family.samples:
                        if sample.name in _LOAD_METRICS:
                            values[sample.name] = values.get(sample.name, 0.0) + sample.value
                up.waiting = int(values.get("vllm:num_requests_waiting", 0))
                up.running = int(values.get("vllm:num_requests_running", 0))
                up.kv_usage = float(values.get("vllm:kv_cache_usage_perc", 0.0))
            except Exception:  # down or slow: the health checker says so, not this
                pass
            self.refresh_trust()
            await asyncio.sleep(self.metrics_interval_s)

    def _warn(self, message: str) -> None:
        now = self._clock()
        if now - self._last_log >= _LOG_EVERY_S:
            self._last_log = now
            logger.warning("kv_aware: %s (further ones in %.0fs only counted)", message, 30)


_LOAD_METRICS = frozenset(
    {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"}
)


def _own(event: Any) -> bool:
    """Whether an event is about the instance's own cache (not the pool)."""
    if isinstance(event, BlockStored | BlockRemoved):
        return event.medium in (None, MEDIUM_GPU)
    return True  # AllBlocksCleared: the instance's own cache
