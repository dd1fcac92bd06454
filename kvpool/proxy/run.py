"""Run the proxy until SIGINT or SIGTERM: the body of ``kvpool proxy``, also called inside
``kvpool up``'s own event loop with a ``stop`` event of its own.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Callable

from kvpool.proxy.config import ProxyConfig
from kvpool.proxy.server import ProxyServer

__all__ = ["run_proxy", "serve"]

log = logging.getLogger("kvpool.proxy")


async def serve(
    config: ProxyConfig,
    stop: asyncio.Event | None = None,
    on_ready: Callable[[ProxyServer], None] | None = None,
) -> None:
    """Start the proxy, wait for ``stop`` (or SIGINT/SIGTERM when no event is given),
    then shut down gracefully."""
    server = ProxyServer(config)
    await server.start()
    own_signals = stop is None
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    if own_signals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    try:
        if on_ready is not None:
            on_ready(server)
        await stop.wait()
        log.info("shutting down: finishing in-flight requests")
    finally:
        if own_signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        await server.stop()


def _announce(server: ProxyServer) -> None:
    cfg = server.config
    print(
        f"kvpool proxy listening on {server.url}  policy={cfg.policy}  "
        f"prefill={','.join(cfg.prefill)}  decode={','.join(cfg.decode)}  "
        f"auth={'api-key' if cfg.api_keys else 'none'}",
        flush=True,
    )


def run_proxy(config: ProxyConfig) -> int:
    """Blocking entry point; returns the process exit status."""
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO,
            stream=sys.stderr,
            format="%(asctime)s %(name)s %(levelname)s %(message)s",
        )
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    try:  # optional speed-up; the proxy is correct without it
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        pass
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve(config, on_ready=_announce))
    return 0
