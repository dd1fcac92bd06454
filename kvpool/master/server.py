"""``kvpool master``: one TCP port for the binary RPC and for HTTP (/metrics, /health,
the status page), as the production guide's §8.1 check
``curl http://<master>:50088/metrics`` expects (which protocol a connection speaks:
:class:`_Sniffer`).  Startup → serve → graceful shutdown, uvicorn style.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import errno
import logging
import os
import signal
import socket
import ssl
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from aiohttp import web

from kvpool.config import MasterConfig
from kvpool.core.objects import IndexConfig
from kvpool.core.registry import Tier
from kvpool.errors import ConfigError, KVPoolError, Overloaded, PeerTimeout, ProtocolError
from kvpool.ha.campaign import Campaign, ClusterKeys, Elected, etcd_timeout_s
from kvpool.ha.etcd import Etcd, parse_endpoints
from kvpool.ha.leadership import Leadership
from kvpool.master.http import build_app
from kvpool.master.service import Later, MasterService
from kvpool.node.storage import MASTER_SETTINGS, LocalStorage
from kvpool.protocol import messages as m
from kvpool.protocol.codec import MAGIC, Codec, FrameDecoder
from kvpool.protocol.data import error_reply
from kvpool.protocol.messages import MASTER_REPLY_CODEC, MasterReply, MasterRequest
from kvpool.security.credentials import Credential
from kvpool.security.handshake import AUTH_MAGIC, Identity
from kvpool.security.master_handshake import AuthProtocol, Owners, no_secret_refusal, plain_refusal
from kvpool.security.peer import ServeSettings
from kvpool.security.secret import load_credential, require_credential
from kvpool.security.tls import ENV_CA, TLSConfig
from kvpool.tenancy.master import TenantMaster, parse_tenant_quotas

__all__ = ["RPC_BUFFER_LIMIT", "RPC_REQUEST_CODEC", "MasterServer", "RpcBuffers", "run_master"]


if TYPE_CHECKING:
    from kvpool.master.kv_events import PoolEventPublisher

log = logging.getLogger("kvpool.master")

TICK_S = 0.1


#: Master requests never carry a payload (the bytes go straight to a segment, never
#: through here), so a header announcing one is refused before a byte of it is read.
RPC_REQUEST_CODEC: Codec[MasterRequest] = Codec(MasterRequest, max_payload=0)
#: Bytes of unfinished requests all RPC connections together may hold.  One connection
#: holds at most one partial frame (the codec's 4 MiB body limit) plus one socket read.
RPC_BUFFER_LIMIT = 64 << 20
#: Once a request has begun, the rest of it must arrive within this long.
RPC_FRAME_TIMEOUT_S = 30.0
#: How long a refused connection is read (and discarded) before it is reset.
RPC_LINGER_S = 2.0
# a peer that opens a connection and never finishes TLS is dropped after this
TLS_HANDSHAKE_TIMEOUT_S = 10.0
#: a new connection's first bytes must arrive this long after it opened, or it is closed
SNIFF_TIMEOUT_S = 5.0
#: connections not yet admitted (sniffed, or in the handshake) at once; one more closes
#: the one that has waited longest, which a real client never is: it proves itself in a
#: round trip, so what waits longest is what a flood left idle
MAX_PRE_AUTH = 4096


#: What answers one connection's requests, chosen when it is admitted: the master's own
#: ``submit``, or the tenant layer's handler of one tenant's connection.
Serve = Callable[[MasterRequest], MasterReply | Later]


class RpcBuffers:
    """What the RPC connections hold of unfinished requests, together (one event loop
    thread: a plain counter)."""

    def __init__(self, limit: int = RPC_BUFFER_LIMIT) -> None:
        self.limit = limit
        self.held = 0


class _RpcProtocol(asyncio.Protocol):
    """One RPC connection.  Rules:

    - Frames are answered in order, one reply each.  While the peer does not read its
      replies (the transport's write buffer is over its high-water mark), no more
      requests are read or answered: a peer cannot grow the reply buffer either.
    - What the decoder holds counts against :class:`RpcBuffers`; a connection that
      would take it over the limit is refused (``Overloaded``) and closed.
    - A bad header (magic, limits, a payload) cannot be resynchronised: an error reply
      and close.  A bad body costs that frame only.
    - A request begun must be complete within ``frame_timeout_s`` (a peer trickling a
      4 MiB body one byte at a time holds no buffer for long).
    - What answers its requests (``serve``) is chosen once, when it is admitted: the
      master's own ``submit``, or a tenant's handler (:meth:`MasterServer.rpc_admitted`).
      Nothing asks per request whose connection it is.
    """

    def __init__(
        self,
        service: MasterService,
        buffers: RpcBuffers,
        frame_timeout_s: float = RPC_FRAME_TIMEOUT_S,
        identity: Identity | None = None,
        owners: Owners | None = None,
        serve: Serve | None = None,
    ) -> None:
        self.identity = identity  # who the handshake proved (None: no credential here)
        self.owners = owners  # the storage owners' ids it may claim (None: no check)
        self.service = service
        self.serve: Serve = serve or service.submit
        self.buffers = buffers
        self.frame_timeout_s = frame_timeout_s
        self.decoder: FrameDecoder[MasterRequest] = FrameDecoder(RPC_REQUEST_CODEC)
        self.transport: asyncio.Transport | None = None
        self._held = 0  # this connection's share of buffers.held
        self._paused = False  # the peer is not reading its replies
        self._closed = False
        self._progress = 0.0  # loop time of the last complete frame (or the first byte)
        self._timer: asyncio.TimerHandle | None = None
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
        if self.owners is not None:
            self.owners.release(self)
        self._closed = True
        self._account()
        if self._timer is not None:
            self._timer.cancel()

    def pause_writing(self) -> None:
        assert self.transport is not None
        self._paused = True
        self.transport.pause_reading()
        if self._timer is None:  # a peer that never reads its replies is dropped too
            self._progress = asyncio.get_running_loop().time()
            self._arm_timer()

    def resume_writing(self) -> None:
        assert self.transport is not None
        self._paused = False
        self._serve()
        if not self._closed and not self._paused and self.waiting is None:
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self._closed:
            return
        if not self.decoder.buffered:
            self._progress = asyncio.get_running_loop().time()
        try:
            self.decoder.feed(data)
        except ProtocolError as exc:  # broken already: the close is on its way
            self._refuse(exc)
            return
        self._serve()

    def _serve(self) -> None:
        """Answer every complete frame buffered, in order, until the peer stops reading
        replies or one's reply must wait (a put waiting for room a node's copy makes, or
        for its node's catalog entry; a node's long-polled heartbeat): then reading pauses
        until it is sent, and every other connection is served meanwhile."""
        assert self.transport is not None
        served = 0
        try:
            while not self._paused and not self._closed and self.waiting is None:
                try:
                    frame = self.decoder.next_frame()
                except ProtocolError as exc:
                    if self._broken():
                        raise
                    self.transport.write(MASTER_REPLY_CODEC.encode(error_reply(exc)))
                    continue
                if frame is None:
                    if self.service.node_copies.laters:  # what this connection did may
                        self.service.settle()  # answer them
                    break
                served += 1
                message = frame.message
                gate = self.service.leadership
                early = gate.answer(message, time.monotonic())
                if early is not None:
                    self.transport.write(MASTER_REPLY_CODEC.encode(early))
                    continue
                if self.owners is not None:
                    refused = self.owners.check(self, self.identity, message)
                    if refused is not None:
                        self._refuse(refused)
                        return
                reply = self.serve(message)
                if gate.ha:
                    self._served(gate, message, reply)
                if isinstance(reply, Later):
                    self.waiting = reply
                    reply.deliver = self._deliver
                    self.transport.pause_reading()
                    self.service.settle()  # e.g. a node's held heartbeat can go now
                    break
                self.transport.write(MASTER_REPLY_CODEC.encode(reply))
        except ProtocolError as exc:
            # A bad header: the stream cannot be resynchronised.  Say why and close.
            self._refuse(exc)
            return
        if served and self.decoder.buffered:  # a frame finished, another has begun
            self._progress = asyncio.get_running_loop().time()
        self._account()
        if self._held > 0 and self.buffers.held > self.buffers.limit:
            self._refuse(
                Overloaded(
                    f"the master holds {self.buffers.held} bytes of unfinished requests "
                    f"(limit {self.buffers.limit}); retry"
                )
            )
            return
        if self.decoder.buffered and self._timer is None:
            self._arm_timer()

    def _served(self, gate: Leadership, message: MasterRequest, reply: object) -> None:
        joined = gate.served(message, m.Ok() if isinstance(reply, Later) else reply)  # type: ignore[arg-type]
        if joined is not None and self.service.on_node_joined is not None:
            assert isinstance(message, m.Register)
            self.service.on_node_joined(joined, message.data_address)

    def _account(self) -> None:
        held = 0 if self._closed else self.decoder.buffered
        self.buffers.held += held - self._held
        self._held = held

    def _arm_timer(self) -> None:
        loop = asyncio.get_running_loop()
        delay = self._progress + self.frame_timeout_s - loop.time()
        self._timer = loop.call_later(max(delay, 0.0), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self._closed or not (self.decoder.buffered or self._paused):
            return
        if asyncio.get_running_loop().time() - self._progress < self.frame_timeout_s:
            self._arm_timer()  # frames completed since: look again later
            return
        if self._paused:
            log.info("closing RPC connection: its replies unread for %gs", self.frame_timeout_s)
            assert self.transport is not None
            self.transport.abort()
            return
        self._refuse(
            PeerTimeout(
                f"request incomplete after {self.frame_timeout_s:g}s "
                f"({self.decoder.buffered} bytes received)"
            )
        )

    def _refuse(self, exc: KVPoolError) -> None:
        """Say why, drop what this connection holds, and close it.

        The close lingers: our end stops writing (FIN) and reads, discarding, what the
        peer still sends, for at most :data:`RPC_LINGER_S`.  Closing with unread bytes
        would send a reset, and the peer's kernel would drop the error reply with it.
        """
        transport = self.transport
        assert transport is not None
        log.info("closing RPC connection: %s", exc)
        transport.write(MASTER_REPLY_CODEC.encode(error_reply(exc)))
        self._closed = True
        self.decoder = FrameDecoder(RPC_REQUEST_CODEC)  # free the partial frame now
        self._account()
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        transport.resume_reading()  # data_received discards from now on
        asyncio.get_running_loop().call_later(RPC_LINGER_S, transport.abort)

    def _deliver(self, reply: MasterReply) -> None:
        """The held reply is ready: send it, then go on with what arrived meanwhile."""
        self.waiting = None
        assert self.transport is not None
        if self._closed or self.transport.is_closing():
            return
        self.transport.write(MASTER_REPLY_CODEC.encode(reply))
        if not self._paused:
            self.transport.resume_reading()
        self._serve()

    def _broken(self) -> bool:
        try:
            self.decoder.feed(b"")
        except ProtocolError:
            return True
        return False


class _Sniffer(asyncio.Protocol):
    """Reads the first bytes of a connection, then hands it to RPC or HTTP.

    Its first four bytes decide: ``KVP1`` (the frame magic) is an RPC connection,
    ``KVPA`` a handshake that leads to one (:mod:`kvpool.security.master_handshake`), anything
    else is handed to aiohttp's HTTP protocol with the bytes already read.  With a
    credential (``--secret_file``, ``KVPOOL_SECRET_FILE``, ``KVPOOL_SECRET``), an RPC
    connection must open with the handshake and HTTP requests need the operator's bearer
    token; without one, a non-loopback ``--host`` refuses to start unless ``--insecure``.
    """

    def __init__(self, server: MasterServer) -> None:
        self.server = server
        self.buffer = b""
        self.transport: asyncio.Transport | None = None
        self.refused = False  # said why and closing: what still arrives is dropped
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.server.waiting(self.transport)
        self._timer = asyncio.get_running_loop().call_later(SNIFF_TIMEOUT_S, self._expired)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _expired(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.server.refused_pre_auth += 1
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        if self.refused:
            return
        self.buffer += data
        if len(self.buffer) < len(MAGIC) and (
            MAGIC.startswith(self.buffer) or AUTH_MAGIC.startswith(self.buffer)
        ):
            return
        server = self.server
        proto: asyncio.Protocol
        if self.buffer.startswith(AUTH_MAGIC):
            if server.credential is None:
                self.refused = True
                no_secret_refusal(self.transport)
                return
            proto = AuthProtocol(server.credential, server.rpc_admitted)
        elif self.buffer.startswith(MAGIC):
            if server.credential is not None:
                self.refused = True
                plain_refusal(self.transport, f"{server.config.host}:{server.port}")
                return
            proto = _RpcProtocol(server.service, server.rpc_buffers, server.rpc_frame_timeout_s)
        else:
            proto = self.server.http_protocol()
        if self._timer is not None:
            self._timer.cancel()  # the next protocol keeps its own clock
        if not isinstance(proto, AuthProtocol):
            self.server.admitted(self.transport)
        self.transport.set_protocol(proto)
        proto.connection_made(self.transport)
        proto.data_received(self.buffer)


class MasterServer:
    """The master process: service, embedded storage, RPC+HTTP listener, tick loop."""

    def __init__(self, config: MasterConfig, *, credential: Credential | None = None) -> None:
        """``credential`` None: the one ``config.secret_file`` or the environment names
        (read at :meth:`start`), if any."""
        self.config = config
        self.credential = credential
        self.tls: ssl.SSLContext | None = None  # the listener's, from --tls_* at start
        self.owners = Owners()
        self.service = MasterService(
            IndexConfig(
                high_watermark=config.eviction_high_watermark_ratio,
                eviction_ratio=config.eviction_ratio,
                lease_ttl_ms=config.default_kv_lease_ttl,
                client_ttl_ms=config.client_ttl_ms,
                enable_offload=config.enable_offload,
                policy=config.eviction_policy,
                replica_num=config.replica_num,
            )
        )
        self.service.config_view = dataclasses.asdict(config)
        self.tenancy = TenantMaster.over(self.service, credential)
        self.rpc_buffers = RpcBuffers()
        self.rpc_frame_timeout_s = RPC_FRAME_TIMEOUT_S
        self.storage: LocalStorage | None = None
        self._server: asyncio.Server | None = None
        self._runner: web.AppRunner | None = None
        self._tick_task: asyncio.Task[None] | None = None
        self.port = config.port
        # connections not yet admitted, oldest first (one event loop: no lock)
        self._pre_auth: collections.OrderedDict[asyncio.Transport, None] = collections.OrderedDict()
        self.refused_pre_auth = 0  # closed before admission: late, or a full room
        self.leadership = Leadership(config.advertised, ha=config.enable_ha)
        self.service.leadership = self.leadership
        self.campaign: Campaign | None = None
        self.exit_code = 0  # 3 once it stopped leading (its supervisor starts it again)
        self._stop: asyncio.Event | None = None

    def waiting(self, transport: asyncio.Transport) -> None:
        """A new connection, not admitted yet; past :data:`MAX_PRE_AUTH` such, the one
        that waited longest is closed."""
        pre_auth = self._pre_auth
        while pre_auth and next(iter(pre_auth)).is_closing():  # gone by themselves
            pre_auth.popitem(last=False)
        pre_auth[transport] = None
        while len(pre_auth) > MAX_PRE_AUTH:
            oldest, _ = pre_auth.popitem(last=False)
            if not oldest.is_closing():
                self.refused_pre_auth += 1
                oldest.abort()

    def admitted(self, transport: asyncio.Transport) -> None:
        self._pre_auth.pop(transport, None)

    def rpc_admitted(self, transport: asyncio.Transport, identity: Identity, rest: bytes) -> None:
        """A handshake succeeded: the connection is RPC from now on, as ``identity``."""
        self.admitted(transport)
        args = (self.service, self.rpc_buffers, self.rpc_frame_timeout_s, identity)
        if identity.role == "tenant":  # all of it in the tenant's namespace: no owners
            proto = _RpcProtocol(*args, serve=self.tenancy.connection(identity.client_id))
        else:
            proto = _RpcProtocol(*args, self.owners)
        transport.set_protocol(proto)
        proto.connection_made(transport)
        if rest:
            proto.data_received(rest)

    def http_protocol(self) -> asyncio.Protocol:
        assert self._runner is not None and self._runner.server is not None
        proto: Any = self._runner.server()
        return proto  # type: ignore[no-any-return]

    async def start(self) -> None:
        """Bind the port, then open the SSD tier and allocate the segment (checked
        against /dev/shm first), then serve.  Every start-up failure is a one-line
        ConfigError naming the flag, and leaves nothing behind."""
        cfg = self.config
        for warning in cfg.warnings():
            log.warning("%s", warning)
        if self.credential is None:
            self.credential = load_credential(cfg.secret_file, os.environ, key="--secret_file")
        if self.credential is not None and not self.credential.is_cluster:
            raise ConfigError(
                "--secret_file: this is a node's credential; the master needs the cluster "
                "secret it was derived from"
            )
        require_credential(cfg.host, self.credential, cfg.insecure, key="--host")
        for tenant, quota in parse_tenant_quotas(cfg.tenant_quota).items():
            self.tenancy.book.set_quota(tenant, quota)
        self.tenancy.credential = self.credential  # the grants' key
        # TLS (off unless --tls_* are set): files checked before anything binds
        tls = TLSConfig(cfg.tls_cert, cfg.tls_key, cfg.tls_ca, prefix="--tls_")
        self.tls = tls.server_context()
        if cfg.kv_events_endpoint:  # a bad endpoint fails here, before anything is served
            self.service.kv_events = self._kv_events(cfg)
        # dialling nodes (copies, demotions) verifies them with --tls_ca, else KVPOOL_TLS_CA
        dial = tls
        if not dial.ca and os.environ.get(ENV_CA):
            dial = dataclasses.replace(dial, ca=os.environ[ENV_CA])
        links = self.service.node_copies.links
        links.secure(
            dataclasses.replace(links.peer, credential=self.credential, tls=dial.client_context())
        )
        listener = _listen(cfg.host, cfg.port)
        try:
            await self._start_on(listener)
        except BaseException:
            listener.close()
            await self.stop(quiet=True)
            raise
        log.info(
            "kvpool master listening on %s:%d (RPC + HTTP /metrics /health /status); "
            "memory segment %d bytes%s; %s; flags: %s",
            cfg.host,
            self.port,
            cfg.segment_size,
            f", SSD tier {cfg.ssd_offload_path} ({cfg.ssd_offload_limit} bytes)"
            if self.storage is not None and self.storage.ssd is not None
            else "",
            (
                "every connection must prove the cluster secret"
                if self.credential is not None
                else "open: no credential configured"
            )
            + ("; TLS" if self.tls is not None else ""),
            dataclasses.replace(cfg, port=self.port).flags_line(),
        )

    async def _start_on(self, listener: socket.socket) -> None:
        cfg = self.config
        ssd_path = cfg.ssd_offload_path if cfg.enable_offload else ""
        if cfg.segment_size or ssd_path:
            self.storage = LocalStorage(
                "master",
                cfg.segment_size,
                host=cfg.host,
                ssd_path=ssd_path,
                ssd_limit=cfg.ssd_offload_limit if ssd_path else 0,
                names=MASTER_SETTINGS,
                listen=ServeSettings(credential=self.credential, tls=self.tls),
                warmup=cfg.segment_warmup,
            )
            self.storage.start()
            self.service.attach_local(self.storage)
        app = build_app(self.service, self.credential, open_metrics=cfg.open_metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        loop = asyncio.get_running_loop()
        # With TLS, RPC and HTTP both run inside it on the one port (HTTP becomes HTTPS);
        # the sniffer sees the decrypted bytes.
        self._server = await loop.create_server(
            lambda: _Sniffer(self),
            sock=listener,
            ssl=self.tls,
            ssl_handshake_timeout=TLS_HANDSHAKE_TIMEOUT_S if self.tls is not None else None,
        )
        self.port = self._server.sockets[0].getsockname()[1]
        if not cfg.rpc_address:  # a free port (0) is known only now
            self.leadership.address = f"{cfg.host}:{self.port}"
            if not cfg.enable_ha:
                self.leadership.leader = self.leadership.address
        # a node's copy reported (on its link thread): settle on the loop, at once
        copies = self.service.node_copies.copies
        copies.wakeup = lambda: loop.call_soon_threadsafe(self.service.settle)
        self._tick_task = asyncio.create_task(self._tick_loop())
        if cfg.enable_ha:
            self._campaign(loop)

    @staticmethod
    def _kv_events(cfg: MasterConfig) -> PoolEventPublisher:
        """The pool's KV events publisher; a bad endpoint is a one-line ConfigError."""
        from kvpool.master.kv_events import PoolEventPublisher

        try:
            events = PoolEventPublisher(cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint)
        except Exception as exc:  # zmq.ZMQError: an address in use, a malformed endpoint
            raise ConfigError(
                f"--kv_events_endpoint {cfg.kv_events_endpoint}"
                f" (--kv_events_replay_endpoint {cfg.kv_events_replay_endpoint or 'none'}):"
                f" {exc}"
            ) from None
        log.info(
            "publishing the pool's KV events on %s (replay: %s)",
            events.endpoint, events.replay_endpoint or "none",
        )  # fmt: skip
        return events

    def _campaign(self, loop: asyncio.AbstractEventLoop) -> None:
        """Campaign on etcd; the leadership is changed on the loop, where it is read."""
        cfg, gate = self.config, self.leadership
        ttl = cfg.ha_lease_ttl
        etcd = Etcd(parse_endpoints(cfg.etcd_endpoints), timeout_s=etcd_timeout_s(ttl))
        warmup_s = cfg.ha_warmup / 1000

        def elected(won: Elected) -> None:
            def apply() -> None:
                gate.elected(won.epoch, won.valid_until, won.nodes, time.monotonic(), warmup_s)
                log.info(
                    "leading epoch %d as %s; %d node(s) to re-announce (at most %gs)",
                    won.epoch, gate.address, len(won.nodes), warmup_s,
                )  # fmt: skip

            loop.call_soon_threadsafe(apply)

        def lost(why: str) -> None:
            gate.lost()  # at once, from this thread too: no request is served after it

            def leave() -> None:
                log.error("stopped leading: %s; leaving (a supervisor starts it as a standby)", why)
                self.exit_code = 3
                if self._stop is not None:
                    self._stop.set()

            loop.call_soon_threadsafe(leave)

        self.campaign = Campaign(
            etcd,
            ClusterKeys(cfg.cluster_id),
            gate.address,
            ttl,
            on_elected=elected,
            on_renewed=lambda until: loop.call_soon_threadsafe(gate.renewed, until),
            on_view=lambda leader, epoch, masters: loop.call_soon_threadsafe(
                gate.follow, leader, epoch, masters
            ),
            on_lost=lost,
        )
        self.service.on_node_joined = self.campaign.node_joined
        self.campaign.start()
        log.info(
            "campaigning for leadership on etcd %s as %s (cluster %s, lease %ds)",
            cfg.etcd_endpoints, gate.address, cfg.cluster_id, ttl,
        )  # fmt: skip

    async def _tick_loop(self) -> None:
        watch = _OffloadWatch(self.service) if self.config.enable_offload else None
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self.service.tick()
                self._warmup_over()
                if watch is not None and watch.check():
                    watch = None  # said once
            except Exception:  # the loop must outlive a bug in one tick
                log.exception("tick failed")

    def _warmup_over(self) -> None:
        gate = self.leadership
        if gate.warming and gate.warm(time.monotonic()) and gate.role == "leader":
            log.warning(
                "%d node(s) the previous leader knew did not re-announce in %gs: serving "
                "without them (%s)",
                len(gate.warming), self.config.ha_warmup / 1000, ", ".join(sorted(gate.warming)),
            )  # fmt: skip
            if self.campaign is not None:
                self.campaign.forget_nodes(set(gate.warming))
            gate.warming.clear()

    async def stop(self, *, quiet: bool = False) -> None:
        if self.campaign is not None:
            # a clean stop hands over at once; one that lost the lease has nothing to end
            self.campaign.stop(resign=not self.campaign.gone)
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
        if self.service.kv_events is not None:
            self.service.kv_events.close()
            self.service.kv_events = None
        if not quiet:
            log.info("kvpool master stopped")

    async def serve_until_signal(self) -> None:
        # the handlers go in before start(): it logs "listening", and a supervisor that
        # signals on that line must find them there, not Python's default (death by -15)
        stop = self._stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await self.start()
        try:
            await stop.wait()
        finally:
            await self.stop()


class _OffloadWatch:
    """``--enable_offload=true`` with no SSD tier anywhere evicts to nowhere: say so once,
    when the first object is evicted from memory while no SSD segment is registered."""

    def __init__(self, service: MasterService) -> None:
        self.service = service

    def check(self) -> bool:
        """True once the warning was given (or can no longer be needed)."""
        if self.service.index.registry.tier_segments(Tier.SSD):
            return False  # demotions have somewhere to go (for now: a node may leave)
        registry = self.service.metrics.registry
        evicted = registry.get_sample_value("kvpool_evictions_total", {"tier": "memory"})
        if not evicted:
            return False
        log.warning(
            "--enable_offload=true but no SSD tier is registered (no --ssd_offload_path "
            "here, no node whose mooncake.json sets enable_ssd_offload and "
            "ssd_offload_path): %d objects evicted from memory were dropped, not demoted",
            int(evicted),
        )
        return True


def _listen(host: str, port: int) -> socket.socket:
    """The master's listening socket, bound before anything is allocated."""
    try:
        # no SO_REUSEPORT: a second master on the same port must fail, not share it
        return socket.create_server((host, port), backlog=1024, reuse_port=False)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"--port {port}: {host}:{port} is already in use (another kvpool master, "
                "or a Mooncake master?); stop it or choose another --port"
            ) from None
        raise ConfigError(
            f"--host {host}: cannot listen on {host}:{port} ({os.strerror(exc.errno or 0)}); "
            "use an address of this machine, or 0.0.0.0"
        ) from None


def _loop_factory() -> Any:
    """uvloop when installed (it roughly halves the RPC round trip), asyncio's otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def run_master(config: MasterConfig) -> int:
    server = MasterServer(config)
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(server.serve_until_signal())
    return server.exit_code
