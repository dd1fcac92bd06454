"""``kvpool master``: one TCP port for the binary RPC and for HTTP (/metrics, /health,
the status page), as the production guide's §8.1 check
``curl http://<master>:50088/metrics`` expects.

Each connection's first four bytes decide: ``KVP1`` (the frame magic) is an RPC
connection, anything else is handed to aiohttp's HTTP protocol with the bytes already
read.  Startup → serve → graceful shutdown, uvicorn style.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import socket
from typing import Any, cast

from aiohttp import web

from kvpool.config import MasterConfig
from kvpool.core.index import IndexConfig
from kvpool.errors import ProtocolError
from kvpool.protocol.codec import MAGIC, FrameDecoder
from kvpool.protocol.data import error_reply
from kvpool.protocol.messages import (
    MASTER_REPLY_CODEC,
    MASTER_REQUEST_CODEC,
    MasterReply,
    MasterRequest,
)
from kvpool.service.http import build_app
from kvpool.service.local_storage import LocalStorage
from kvpool.service.master import Later, MasterService

__all__ = ["MasterServer", "run_master"]

log = logging.getLogger("kvpool.master")

TICK_S = 0.1


class _RpcProtocol(asyncio.Protocol):
    def __init__(self, service: MasterService) -> None:
        self.service = service
        self.decoder: FrameDecoder[MasterRequest] = FrameDecoder(MASTER_REQUEST_CODEC)
        self.transport: asyncio.Transport | None = None
        self.waiting: Later | None = None  # a reply held back (then reading is paused)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.service.rpc_connections += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self.service.rpc_connections -= 1

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        try:
            self.decoder.feed(data)
            if self.waiting is None:
                self._serve()
        except ProtocolError as exc:
            self._refuse(exc)

    def _serve(self) -> None:
        """Answer the frames received, in order, until one's reply must wait (a put
        waiting for room a node's copy makes, or for its node's catalog entry; a node's
        long-polled heartbeat): reading pauses until it is sent, and every other
        connection is served meanwhile."""
        assert self.transport is not None
        try:
            while True:
                try:
                    frame = self.decoder.next_frame()
                except ProtocolError as exc:
                    if self._broken():
                        raise
                    self.transport.write(MASTER_REPLY_CODEC.encode(error_reply(exc)))
                    continue
                if frame is None:
                    if self.service.laters:  # what this connection did may answer them
                        self.service.settle()
                    return
                reply = self.service.submit(frame.message)
                if isinstance(reply, Later):
                    self.waiting = reply
                    reply.deliver = self._deliver
                    self.transport.pause_reading()
                    self.service.settle()  # e.g. a node's held heartbeat can go now
                    return
                self.transport.write(MASTER_REPLY_CODEC.encode(reply))
        except ProtocolError as exc:
            self._refuse(exc)

    def _refuse(self, exc: ProtocolError) -> None:
        # A bad header: the stream cannot be resynchronised.  Say why and close.
        assert self.transport is not None
        log.info("closing RPC connection: %s", exc)
        self.transport.write(MASTER_REPLY_CODEC.encode(error_reply(exc)))
        self.transport.close()

    def _deliver(self, reply: MasterReply) -> None:
        """The held reply is ready: send it, then go on with what arrived meanwhile."""
        self.waiting = None
        assert self.transport is not None
        if self.transport.is_closing():
            return
        self.transport.write(MASTER_REPLY_CODEC.encode(reply))
        self.transport.resume_reading()
        self._serve()

    def _broken(self) -> bool:
        try:
            self.decoder.feed(b"")
        except ProtocolError:
            return True
        return False


class _Sniffer(asyncio.Protocol):
    """Reads the first bytes of a connection, then hands it to RPC or HTTP."""

    def __init__(self, server: MasterServer) -> None:
        self.server = server
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        self.buffer += data
        if len(self.buffer) < len(MAGIC) and MAGIC.startswith(self.buffer):
            return
        proto: asyncio.Protocol
        if self.buffer.startswith(MAGIC):
            proto = _RpcProtocol(self.server.service)
        else:
            proto = self.server.http_protocol()
        self.transport.set_protocol(proto)
        proto.connection_made(self.transport)
        proto.data_received(self.buffer)


class MasterServer:
    """The master process: service, embedded storage, RPC+HTTP listener, tick loop."""

    def __init__(self, config: MasterConfig) -> None:
        self.config = config
        self.service = MasterService(
            IndexConfig(
                high_watermark=config.eviction_high_watermark_ratio,
                eviction_ratio=config.eviction_ratio,
                lease_ttl_ms=config.default_kv_lease_ttl,
                client_ttl_ms=config.client_ttl_ms,
                enable_offload=config.enable_offload,
                policy=config.eviction_policy,
            )
        )
        self.service.config_view = dataclasses.asdict(config)
        self.storage: LocalStorage | None = None
        self._server: asyncio.Server | None = None
        self._runner: web.AppRunner | None = None
        self._tick_task: asyncio.Task[None] | None = None
        self.port = config.port

    def http_protocol(self) -> asyncio.Protocol:
        assert self._runner is not None and self._runner.server is not None
        proto: Any = self._runner.server()
        return proto  # type: ignore[no-any-return]

    async def start(self) -> None:
        cfg = self.config
        ssd_path = cfg.ssd_offload_path if cfg.enable_offload else ""
        if cfg.segment_size or ssd_path:
            self.storage = LocalStorage(
                "master",
                cfg.segment_size,
                host=cfg.host,
                ssd_path=ssd_path,
                ssd_limit=cfg.ssd_offload_limit if ssd_path else 0,
            )
            self.storage.start()
            self.service.attach_local(self.storage)
        self._runner = web.AppRunner(build_app(self.service), access_log=None)
        await self._runner.setup()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Sniffer(self), cfg.host, cfg.port, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]
        # a node's copy reported (on its link thread): settle on the loop, at once
        self.service.copies.wakeup = lambda: loop.call_soon_threadsafe(self.service.settle)
        self._tick_task = asyncio.create_task(self._tick_loop())
        log.info(
            "kvpool master listening on %s:%d (RPC + HTTP /metrics /health /status); "
            "memory segment %d bytes%s",
            cfg.host,
            self.port,
            cfg.segment_size,
            f", SSD tier {ssd_path} ({cfg.ssd_offload_limit} bytes)" if ssd_path else "",
        )

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self.service.tick()
            except Exception:  # the loop must outlive a bug in one tick
                log.exception("tick failed")

    async def stop(self) -> None:
        if self._tick_task is not None:
            self._tick_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._tick_task
        if self._server is not None:
            self._server.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if self.storage is not None:
            self.storage.close()
        self.service.close()
        log.info("kvpool master stopped")

    async def serve_until_signal(self) -> None:
        await self.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await self.stop()


def _loop_factory() -> Any:
    """uvloop when installed (it roughly halves the RPC round trip), asyncio's otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def run_master(config: MasterConfig) -> int:
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(MasterServer(config).serve_until_signal())
    return 0
