"""The client's way to its master's request handler: over TCP, or in this process.

An :class:`~kvpool.protocol.data.Error` reply is returned, not raised; a failure of the
link itself raises ``TransferError`` or ``PeerTimeout``.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from typing import Protocol

from kvpool.datapath import framing
from kvpool.datapath.channel import Channel, reply_spin_us
from kvpool.errors import (
    AuthError,
    ConfigError,
    KVPoolError,
    PeerTimeout,
    ProtocolError,
    TransferError,
)
from kvpool.named import resolve
from kvpool.net import split_address
from kvpool.protocol import messages as m
from kvpool.protocol.data import Error
from kvpool.security.peer import PLAIN_PEER, PeerSettings
from kvpool.security.socket_auth import authenticate
from kvpool.security.socket_tls import speaks_tls, tls_required, wrap_client

__all__ = [
    "CLOSE_SETTLE_S",
    "FOREIGN_MASTERS",
    "MasterLink",
    "TcpMasterLink",
    "foreign_master",
]

log = logging.getLogger("kvpool.client")

#: how long a closing link waits for the replies it is owed
CLOSE_SETTLE_S = 1.0

# A master address can turn out to be another engine's master, whose port closes a kvpool
# frame without a byte, and retrying that is forever.  So when the first exchange on a
# fresh connection ends without a kvpool reply (closed, or bytes that are no kvpool
# frame), each probe here asks the port one cheap question in its engine's protocol and,
# if it was answered, the call raises the probe's ConfigError.  Probing only after a
# failure keeps a kvpool master's path free of it.  The probes live with their engines,
# above the client, so they are named (kvpool.named), not imported.
#: probes of other engines' masters: "module:attr" of (address, timeout_s) -> the
#: ConfigError that says what answered there, or None
FOREIGN_MASTERS: tuple[str, ...] = ("kvpool.mooncake.sniff:foreign_master",)


def foreign_master(address: str, timeout_s: float) -> ConfigError | None:
    """The error naming the other engine's master at ``address``, or None (each probe is
    one bounded exchange)."""
    for probe in FOREIGN_MASTERS:
        error: ConfigError | None = resolve(probe)(address, timeout_s)
        if error is not None:
            return error
    return None


class MasterLink(Protocol):
    """Carries one client's requests to a master's handler, in order."""

    #: whether :meth:`post` returns before the master answered and :meth:`call` can
    #: overlap the caller's work with the round trip
    pipelined: bool

    def call(
        self, request: m.MasterRequest, meanwhile: Callable[[], object] | None = None
    ) -> m.MasterReply:
        """One round trip; ``meanwhile`` (if any) runs while the master handles it."""
        ...

    def post(self, request: m.MasterRequest) -> None:
        """Send a request whose answer nobody needs; never raises (what it undoes
        expires on the master anyway)."""
        ...

    def close(self) -> None: ...


def _owed_reply(reply: m.MasterReply) -> None:
    """The reply to a posted request: only an error is worth a word, and not a loud one
    (a release of a lease that already expired is no one's problem)."""
    if isinstance(reply, Error):
        log.debug("a request sent without waiting failed: %s: %s", reply.code, reply.message)


# One connection to `kvpool master`, opened on first use and again after a failure.  It
# pipelines: post() sends a request whose answer nobody waits for, and its reply is read
# just before the next call's own, and call() runs the caller's `meanwhile` while the
# master works.
class TcpMasterLink:
    """One TCP connection to ``kvpool master`` at ``address``; thread-safe (calls are
    serialised on the connection).  ``peer``: its timeout, TLS context, and the
    credential each new connection opens with in the handshake, as ``role``
    (``client``, or ``node`` for a storage node) and ``peer.client_id``; a refusal
    raises :class:`~kvpool.errors.AuthError`."""

    pipelined = True

    def __init__(
        self, address: str, peer: PeerSettings = PLAIN_PEER, *, role: str = "client"
    ) -> None:
        self.peer = peer
        self.role = role
        self.address = address
        self.timeout_s = peer.timeout_s
        self._channel: Channel[m.MasterRequest, m.MasterReply] | None = None
        self._lock = threading.Lock()
        self._fresh = False  # the channel has not brought back a kvpool reply yet
        self.spin_us = reply_spin_us()

    def call(
        self, request: m.MasterRequest, meanwhile: Callable[[], object] | None = None
    ) -> m.MasterReply:
        with self._lock:
            channel = self._connected()
            try:
                reply, payload = channel.call(request, meanwhile=meanwhile)
                if payload:
                    channel.discard_payload(payload)
            except (TransferError, ProtocolError) as exc:
                fresh = self._fresh
                self._drop()
                # PeerTimeout is neither: a silent peer is no sign of another protocol
                foreign = foreign_master(self.address, min(self.timeout_s, 2.0)) if fresh else None
                if foreign is not None:
                    raise foreign from exc
                if fresh and self._tls_expected():
                    raise tls_required(f"the master at {self.address}") from exc
                raise
            except KVPoolError:
                self._drop()
                raise
            self._fresh = False
            if isinstance(reply, Error) and reply.code == AuthError.code:
                self._drop()  # a refusal: the master closes this connection after it
        return reply

    def post(self, request: m.MasterRequest) -> None:
        with self._lock:
            try:
                self._connected().post(request)
            except KVPoolError as exc:
                self._drop()
                log.debug("%s not sent: %s", type(request).__name__, exc)

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                # Read the owed replies first: closing a socket with unread bytes resets
                # the connection, and a reset can discard a release the master has not
                # read yet.  Bounded, so a hung master does not hold up the close.
                try:
                    self._channel.settle(min(self.timeout_s, CLOSE_SETTLE_S))
                except KVPoolError as exc:
                    log.debug("replies owed at close not read: %s", exc)
            self._drop()

    def _connected(self) -> Channel[m.MasterRequest, m.MasterReply]:
        if self._channel is None:
            host, port = split_address(self.address)
            try:
                sock = socket.create_connection((host, port), timeout=self.timeout_s)
            except TimeoutError:
                raise PeerTimeout(f"connecting to the master at {self.address} timed out") from None
            except OSError as exc:
                raise TransferError(f"cannot reach the master at {self.address}: {exc}") from None
            framing.tune_socket(sock)
            if self.peer.tls is not None:
                where = f"the master at {self.address}"
                sock = wrap_client(sock, self.peer.tls, host, self.timeout_s, where)
            if self.peer.credential is not None:
                self._authenticate(sock)
            self._channel = Channel(
                sock,
                m.MASTER_REQUEST_CODEC,
                m.MASTER_REPLY_CODEC,
                self.timeout_s,
                _owed_reply,
                spin_us=self.spin_us,
            )
            self._fresh = True
        return self._channel

    def _authenticate(self, sock: socket.socket) -> None:
        where = f"the master at {self.address}"
        credential = self.peer.credential
        assert credential is not None
        role, client_id = self.role, self.peer.client_id
        if credential.is_tenant and role == "client":
            # a tenant's credential proves its tenant, named as the handshake's id: the
            # master puts this connection's keys in that tenant's namespace
            role, client_id = "tenant", credential.tenant
        try:
            authenticate(sock, credential, role, client_id, self.timeout_s, where)
        except AuthError as exc:
            sock.close()
            foreign = foreign_master(self.address, 2.0) if exc.__cause__ is not None else None
            if foreign is not None:
                raise foreign from exc
            if exc.__cause__ is not None and self._tls_expected():
                raise tls_required(f"the master at {self.address}") from exc
            raise
        except BaseException:
            sock.close()
            raise

    def _tls_expected(self) -> bool:
        """A plain client closed on at once: does the master speak TLS?"""
        if self.peer.tls is not None:
            return False
        host, port = split_address(self.address)
        return speaks_tls(host, port, min(self.timeout_s, 2.0))

    def _drop(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
