"""The segment data server: serves :mod:`kvpool.protocol.data` requests against the segments
a node holds, one thread per connection (:mod:`kvpool.datapath.server` says why).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
from collections.abc import Callable

from kvpool.closing import Serving
from kvpool.datapath import framing
from kvpool.datapath.budget import ByteBudget
from kvpool.datapath.channel import Channel
from kvpool.datapath.framing import BadRequest
from kvpool.datapath.server import ServerStats, ThreadedServer, keepalive
from kvpool.errors import (
    AuthError,
    ChecksumMismatch,
    KVPoolError,
    ObjectNotFound,
    Overloaded,
    PeerTimeout,
    ProtocolError,
    TransferError,
    UnknownSegment,
)
from kvpool.protocol.data import (
    DATA_REPLY_CODEC,
    DATA_REQUEST_CODEC,
    DataReply,
    DataRequest,
    Error,
    Ok,
    SegmentDemote,
    SegmentInfoReply,
    SegmentRead,
    SegmentReadMany,
    SegmentWrite,
    SegmentWriteMany,
    SsdRead,
    SsdRemove,
    error_reply,
)
from kvpool.security.admission import Admission
from kvpool.security.credentials import Credential
from kvpool.security.handshake import AUTH_MAGIC, Identity, refusal
from kvpool.storage.segment import Segment
from kvpool.storage.ssd import SsdStore

__all__ = [
    "DATA_IDLE_TIMEOUT_S",
    "DATA_MAX_CONNECTIONS",
    "MAX_RANGES",
    "SSD_READ_BUDGET",
    "Handle",
    "RequestCheck",
    "SegmentServer",
    "ServerStats",
]

log = logging.getLogger(__name__)

#: A data connection quiet this long between requests is closed (its client reconnects
#: on its next request); as long as a client's default ``client_ttl``.
DATA_IDLE_TIMEOUT_S = 120.0
#: Data connections served at once: each client process holds one per node it talks to.
DATA_MAX_CONNECTIONS = 256
#: Bytes of SSD objects being read into memory for sending, all connections together.
SSD_READ_BUDGET = 256 << 20
#: Ranges per SegmentReadMany / SegmentWriteMany (a reply's views go in one sendmsg,
#: which takes at most 1024 buffers).
MAX_RANGES = 512

_Channel = Channel[DataReply, DataRequest]
#: One request served: ``(channel, request, its payload's length)`` -> the reply and its
#: payload.  A connection's is chosen once, when it is admitted.
_Served = tuple[DataReply, memoryview | list[memoryview] | None]
Handle = Callable[[_Channel, DataRequest, int], _Served]
#: What a request must pass before it is served: the request as served, or it raises the
#: AuthError refusing it.  Made per tenant connection: ``(node key, tenant) -> check``
#: (:func:`kvpool.tenancy.grants.tenant_check`).
RequestCheck = Callable[[DataRequest], DataRequest]


# Rules:
#
# - A write's payload is received with ``recv_into`` straight into the segment's memory;
#   a read is sent with ``sendall`` of a view of the segment.  No copy in Python.
# - A refused write (unknown segment, out of range) still drains its payload, then
#   replies :class:`~kvpool.protocol.data.Error`; the connection stays usable.
# - A frame whose body does not decode (unknown tag) gets an ``Error`` reply and the
#   connection goes on; a bad header (magic, oversized) gets an ``Error`` and the
#   connection is closed.  Either way only that connection is affected.
# - Once a request has started, every wait is bounded by ``timeout_s`` (see
#   :class:`~kvpool.datapath.channel.Channel`); a client that vanishes mid-payload only ends
#   its own connection thread.
# - What a peer can make the server hold is bounded.  Per connection: a thread, an 8 KiB
#   stage, one request body (the codec's 4 MiB limit), a 1 MiB scratch buffer to drain a
#   refused write; payloads go straight into segments and are never buffered.  In total:
#   at most ``max_connections`` connections (one more gets an ``Overloaded`` error and is
#   closed), and SSD reads -- the one buffer that scales with an object -- share
#   ``ssd_read_budget`` bytes (a read that finds no room in ``timeout_s`` is ``Overloaded``;
#   the connection goes on).  A connection quiet for ``idle_timeout_s`` between requests is
#   closed (noticed within ``timeout_s`` after: the kernel's receive timeout is the clock),
#   so idle peers do not keep threads forever; clients reconnect on their next request.
# - With a ``credential``, a connection's first exchange is the handshake of
#   :mod:`kvpool.security.handshake` in role ``data``, proving the key of the node that serves
#   (``server_id``); a peer that skips it or fails it gets an
#   :class:`~kvpool.errors.AuthError` reply and is closed, and nothing else is read from it.
# - A tenant's connection (role ``tenant-data``, the tenant's data key) is admitted only
#   where ``tenants`` is given; its requests pass the check that makes for it (the
#   master's grants, :mod:`kvpool.tenancy.grants`) before they are served.  A refused one
#   gets an ``AuthError`` reply, the payload of a refused write is drained, and the
#   connection goes on.  Which handling a connection gets is chosen once, at admission:
#   the plain path tests nothing per request.
class SegmentServer(Serving):
    """Serves reads and writes of registered segments over TCP.

    ``host_token`` and each segment's shared-memory name are advertised through
    ``SegmentInfo`` so same-host clients can bypass TCP (see :mod:`kvpool.datapath.path`).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        timeout_s: float = 10.0,
        idle_timeout_s: float | None = DATA_IDLE_TIMEOUT_S,
        host_token: str = "",
        ssd: SsdStore | None = None,
        max_connections: int = DATA_MAX_CONNECTIONS,
        ssd_read_budget: int = SSD_READ_BUDGET,
        credential: Credential | None = None,
        server_id: str = "",
        tls: ssl.SSLContext | None = None,
        tenants: Callable[[bytes, str], RequestCheck] | None = None,
    ) -> None:
        """``tenants``: the check of a tenant connection's requests, made from this
        node's key and the tenant (None: tenants are refused at the handshake)."""
        self.host = host
        self.tls = tls
        self.credential = credential
        self.server_id = server_id
        self.tenants = tenants
        self._node_key = b""  # this server's node key, for checking tenants' grants
        # told of every tagged write once its bytes are in: segment id, key, offset,
        # length, checksum (the node's catalog notes it; see SegmentWrite)
        self.on_write: Callable[[str, str, int, int, int], None] | None = None
        self.ssd = ssd
        self.port = port
        self.timeout_s = timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.host_token = host_token
        self.stats = ServerStats()
        self.ssd_reads = ByteBudget(ssd_read_budget)
        self._segments: dict[str, Segment] = {}
        self._lock = threading.Lock()
        self._server = ThreadedServer(
            host,
            port,
            self._serve_connection,
            name="kvpool-data",
            on_connection=lambda: self.stats.add("connections"),
            max_connections=max_connections,
            refuse=self._refuse,
            tls=tls,
            refuse_plain=self._refuse_plain,
            tls_timeout_s=timeout_s,
            admission=self._admission if credential is not None else None,
            on_refused=self._refused_auth,
        )

    # -- segments ---------------------------------------------------------------

    def add_segment(self, segment_id: str, segment: Segment) -> None:
        """Serve ``segment`` under ``segment_id`` (replacing any previous one)."""
        with self._lock:
            self._segments[segment_id] = segment

    def _segment(self, segment_id: str) -> Segment:
        with self._lock:
            segment = self._segments.get(segment_id)
        if segment is None:
            raise UnknownSegment(f"segment {segment_id!r} is not served here")
        return segment

    # -- lifecycle --------------------------------------------------------------

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` actually bound (the port is chosen when 0 was asked)."""
        return self.host, self.port

    def bind(self) -> tuple[str, int]:
        """Bind and listen without accepting yet (see :meth:`ThreadedServer.bind`)."""
        self.host, self.port = self._server.bind()
        return self.address

    def start(self) -> tuple[str, int]:
        """Bind (unless :meth:`bind` did), listen, and start accepting; returns the bound
        address."""
        self.host, self.port = self._server.start()
        return self.address

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, end every connection, and wait (bounded) for their threads."""
        self._server.close(timeout_s)

    @property
    def connections(self) -> int:
        """Connections open now."""
        return self._server.connections

    # -- one connection ---------------------------------------------------------

    def _refuse(self, conn: socket.socket) -> None:
        """The reply a connection over the limit gets to its first request."""
        limit = self._server.max_connections
        error = Overloaded(
            f"data server {self.host}:{self.port} is serving its limit of {limit} "
            "connections; retry later, or close idle clients"
        )
        conn.sendall(DATA_REPLY_CODEC.encode(error_reply(error)))

    def _refuse_plain(self, head: bytes) -> bytes:
        """What a client without TLS reads from a TLS port: a refusal in the handshake's
        words if it began one, else a data error reply."""
        error = AuthError(
            f"data server {self.host}:{self.port} requires TLS: set KVPOOL_TLS_CA (or the "
            "node config's tls_ca) to the CA that signed its certificate"
        )
        if head.startswith(AUTH_MAGIC[: len(head)]):
            return refusal(str(error))
        return DATA_REPLY_CODEC.encode(error_reply(error))

    def _serve_connection(self, conn: socket.socket, identity: Identity | None) -> None:
        """One client's conversation, in its own thread (the server closes ``conn``);
        with a credential, the waiting room has run the handshake (``identity``)."""
        framing.tune_socket(conn)
        keepalive(conn)
        handle: Handle = self._handle
        if identity is not None and identity.role == "tenant-data":
            handle = self._checked(self._tenant_check(identity.client_id))
        channel: _Channel = Channel(conn, DATA_REPLY_CODEC, DATA_REQUEST_CODEC, self.timeout_s)
        try:
            while not self._server.stopping and self._serve_one(channel, handle):
                pass
        except ProtocolError as exc:
            # Bad header: the stream cannot be resynchronised.  Say why, then close.
            self.stats.add("protocol_errors")
            log.warning("closing data connection after a malformed frame: %s", exc)
            with contextlib.suppress(KVPoolError):
                self._reply(channel, error_reply(exc))
        except (TransferError, PeerTimeout) as exc:
            self.stats.add("dropped_connections")
            log.info("data connection ended: %s", exc)

    def _admission(self) -> Admission:
        """A fresh connection's handshake, as the waiting room runs it."""
        assert self.credential is not None
        plain = AuthError(
            f"data server {self.host}:{self.port} requires a credential: set "
            "KVPOOL_SECRET_FILE (or KVPOOL_SECRET) to this cluster's secret"
        )
        refuse_plain = DATA_REPLY_CODEC.encode(error_reply(plain))
        roles = ("data", "tenant-data") if self.tenants is not None else ("data",)
        return Admission(self.credential, self.server_id, roles, refuse_plain)

    def _refused_auth(self, reason: str) -> None:
        self.stats.add("refused_auth")
        n = self.stats.refused_auth
        if n & (n - 1) == 0:  # the 1st, 2nd, 4th, ...: a flood logs little
            log.warning("data connection refused (%d so far): %s", n, reason)

    def _tenant_check(self, tenant: str) -> RequestCheck:
        """The check of ``tenant``'s requests (admitted only where ``tenants`` is set)."""
        assert self.credential is not None and self.tenants is not None
        node_key = self._node_key
        if not node_key:  # derived once: the grants of every request are MACed with it
            node_key = self._node_key = self.credential.node_key_of(self.server_id)
        return self.tenants(node_key, tenant)

    def _checked(self, check: RequestCheck) -> Handle:
        """The handling of a connection whose every request passes ``check`` first."""

        def handle(channel: _Channel, request: DataRequest, payload_length: int) -> _Served:
            try:
                request = check(request)
            except AuthError:
                self.stats.add("refused_grants")
                channel.discard_payload(payload_length)
                raise
            return self._handle(channel, request, payload_length)

        return handle

    def _reply(
        self,
        channel: Channel[DataReply, DataRequest],
        reply: DataReply,
        payload: memoryview | list[memoryview] | None = None,
    ) -> None:
        if isinstance(reply, Error):
            self.stats.add("error_replies")
        if isinstance(payload, list):
            channel.send_parts(reply, payload)  # a ranged read: the views, gathered
        else:
            channel.send(reply, payload)

    def _serve_one(self, channel: _Channel, handle: Handle) -> bool:
        """Handle one request with ``handle`` (the connection's, chosen at admission);
        ``False`` when the peer closed cleanly."""
        got = channel.recv_request(self.idle_timeout_s)
        if got is None:
            return False
        if isinstance(got, BadRequest):
            self.stats.add("protocol_errors")
            self._reply(channel, error_reply(got.error))
            return True
        request, payload_length = got
        self.stats.add("requests")
        try:
            reply, payload = handle(channel, request, payload_length)
        except ChecksumMismatch as exc:  # a corrupt SSD object: a miss, not a broken link
            self._reply(channel, error_reply(exc))
            return True
        except (TransferError, PeerTimeout):
            raise
        except KVPoolError as exc:
            self._reply(channel, error_reply(exc))
            return True
        try:
            self._reply(channel, reply, payload)
        finally:
            if isinstance(request, SsdRead) and isinstance(payload, memoryview):
                payload.release()
                self.ssd_reads.give(request.length)
        return True

    def _handle(
        self, channel: Channel[DataReply, DataRequest], request: DataRequest, payload_length: int
    ) -> tuple[DataReply, memoryview | list[memoryview] | None]:
        if isinstance(request, SegmentReadMany | SegmentWriteMany):
            return self._ranges(channel, request, payload_length)
        expected = request.length if isinstance(request, SegmentWrite) else 0
        if payload_length != expected:
            channel.discard_payload(payload_length)
            raise ProtocolError(
                f"{type(request).__name__} declares {expected} payload bytes, "
                f"frame carries {payload_length}"
            )
        if isinstance(request, SegmentWrite):
            try:
                target = self._segment(request.segment_id).view(request.offset, request.length)
            except KVPoolError:
                channel.discard_payload(payload_length)
                raise
            channel.recv_payload_into(target)  # straight into the segment's memory
            self.stats.add("bytes_written", request.length)
            if request.key and self.on_write is not None:
                self.on_write(
                    request.segment_id,
                    request.key,
                    request.offset,
                    request.length,
                    request.checksum,
                )
            return Ok(), None
        if isinstance(request, SegmentRead):
            source = self._segment(request.segment_id).view(request.offset, request.length)
            self.stats.add("bytes_read", request.length)
            return Ok(request.length), source
        if isinstance(request, SsdRead):
            return self._ssd_read(request)
        if isinstance(request, SegmentDemote):
            return self._demote(request)
        if isinstance(request, SsdRemove):
            if self.ssd is not None:
                for key in request.keys:
                    self.ssd.remove(key)
            return Ok(), None
        segment = self._segment(request.segment_id)
        info = SegmentInfoReply(request.segment_id, segment.size, segment.name, self.host_token)
        return info, None

    def _ranges(
        self,
        channel: Channel[DataReply, DataRequest],
        request: SegmentReadMany | SegmentWriteMany,
        payload_length: int,
    ) -> tuple[DataReply, list[memoryview] | None]:
        """A batch in one request: every range is checked before a byte moves, so a
        refusal leaves nothing half done (the client then asks per range)."""
        total = sum(length for _, _, length in request.ranges)
        write = isinstance(request, SegmentWriteMany)
        name = type(request).__name__
        if payload_length != (total if write else 0):
            channel.discard_payload(payload_length)
            raise ProtocolError(f"{name} of {total} bytes, frame carries {payload_length}")
        notes = request.notes if isinstance(request, SegmentWriteMany) else []
        if notes and len(notes) != len(request.ranges):
            channel.discard_payload(payload_length)
            raise ProtocolError(
                f"{name} of {len(request.ranges)} ranges with {len(notes)} notes: one per "
                "range, or none"
            )
        if len(request.ranges) > MAX_RANGES or total > DATA_REPLY_CODEC.max_payload:
            # a reply is one sendmsg of its views, and one frame
            channel.discard_payload(payload_length)
            raise ProtocolError(
                f"{name} of {len(request.ranges)} ranges and {total} bytes: at most "
                f"{MAX_RANGES} ranges and {DATA_REPLY_CODEC.max_payload} bytes per request"
            )
        try:
            views = [self._segment(s).view(o, n) for s, o, n in request.ranges]
        except KVPoolError:
            channel.discard_payload(payload_length)
            raise
        if not write:
            self.stats.add("bytes_read", total)
            return Ok(total), views
        for target in views:
            channel.recv_payload_into(target)  # straight into the segments' memory
        self.stats.add("bytes_written", total)
        if notes and self.on_write is not None:
            for (segment_id, offset, length), (key, csum) in zip(
                request.ranges, notes, strict=True
            ):
                self.on_write(segment_id, key, offset, length, csum)
        return Ok(), None

    def _demote(self, request: SegmentDemote) -> tuple[DataReply, memoryview | None]:
        if self.ssd is None:
            raise UnknownSegment("this node has no SSD tier")
        data = self._segment(request.segment_id).view(request.offset, request.length)
        # a changed copy is refused (ChecksumMismatch, an error reply) and never kept
        self.ssd.put(request.key, data, expect=request.checksum or None)
        return Ok(), None

    def _ssd_read(self, request: SsdRead) -> tuple[DataReply, memoryview | None]:
        """An SSD object into a fresh buffer (the file is checked before anything is
        sent, so a corrupt object is an error reply, never a payload)."""
        if self.ssd is None:
            raise ObjectNotFound(f"{request.key}: this node has no SSD tier")
        size = self.ssd.value_size(request.key)
        if size != request.length:
            raise ObjectNotFound(
                f"{request.key} on SSD has {size} bytes, the request expects {request.length}"
            )
        if not self.ssd_reads.take(size, self.timeout_s):
            raise Overloaded(
                f"{request.key}: {self.ssd_reads.held} bytes of SSD reads in flight "
                f"(budget {self.ssd_reads.limit}); retry"
            )
        try:
            buf = memoryview(bytearray(size))
            self.ssd.read_into(request.key, buf)
        except BaseException:
            self.ssd_reads.give(size)
            raise
        self.stats.add("bytes_read", size)
        return Ok(size), buf
