"""Background health checker: polls every endpoint's ``/health`` and moves it in and out
of rotation.  The first round runs at once, then one round every ``interval_s``.  Every
poll is bounded by ``timeout_s``, so a dead peer costs one timeout, never a hang."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

import aiohttp

from kvpool.proxy.metrics import ProxyMetrics
from kvpool.proxy.routing import Upstream, UpstreamGroup

__all__ = ["HealthChecker"]

log = logging.getLogger("kvpool.proxy")


class HealthChecker:
    def __init__(
        self,
        groups: Sequence[UpstreamGroup],
        interval_s: float,
        timeout_s: float,
        metrics: ProxyMetrics,
    ) -> None:
        self.groups = list(groups)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.rounds = 0
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        # its own small session, so polls never queue behind a full request pool
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            connector=aiohttp.TCPConnector(limit=32, force_close=True),
        )
        self._task = asyncio.create_task(self._loop(), name="kvpool-proxy-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _loop(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.interval_s)

    async def poll_once(self) -> None:
        await asyncio.gather(
            *(self._poll(group, up) for group in self.groups for up in group.upstreams)
        )
        self.rounds += 1

    async def _poll(self, group: UpstreamGroup, up: Upstream) -> None:
        assert self._session is not None
        try:
            async with self._session.get(up.url + "/health") as resp:
                await resp.read()
                reason = "" if resp.status == 200 else f"/health answered HTTP {resp.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            reason = f"/health failed: {exc!r}"
        if not reason:
            if group.mark_up(up.url):
                log.info("%s endpoint %s back in rotation", group.role, up.url)
                self.metrics.upstream_healthy.labels(group.role, up.url).set(1)
            return
        if group.mark_down(up.url, reason):
            log.warning("%s endpoint %s out of rotation: %s", group.role, up.url, reason)
            self.metrics.errors.labels(group.role, "health").inc()
            self.metrics.upstream_healthy.labels(group.role, up.url).set(0)
