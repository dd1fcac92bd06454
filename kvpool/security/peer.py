"""How this process dials a peer's port, and how its own data port admits peers.

A :class:`PeerSettings` is made once, where the settings are known (a client's
constructor, a node's config, the master's flags), and handed down unchanged to each
link and data path that opens a socket: the master link, a node's data connection, the
master's own links to nodes.  So those four settings travel together and are never
passed, or forgotten, one by one.  :class:`ServeSettings` is the listening side's
counterpart, handed to the storage that serves a data port.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from kvpool.security.credentials import Credential

__all__ = ["PLAIN_PEER", "PLAIN_SERVE", "PeerSettings", "ServeSettings"]


# Rules: `timeout_s` bounds every connect and exchange (a wait never hangs); `credential`
# None means no handshake, else the connection proves it as `client_id`
# (kvpool.security.handshake); `tls` None means plain TCP, else a *client* context that
# verifies the peer (kvpool.security.tls.TLSConfig.client_context).
@dataclass(frozen=True, slots=True)
class PeerSettings:
    """The timeout, credential, handshake id and TLS context of a dialing end."""

    timeout_s: float = 10.0
    credential: Credential | None = None
    client_id: str = ""
    tls: ssl.SSLContext | None = None


#: plain TCP, no handshake, 10 s: how a peer is dialled when nothing says otherwise
PLAIN_PEER = PeerSettings()


# Rules: `timeout_s` bounds every exchange with a connected peer; `credential` None means
# the port admits peers without a handshake, else each must prove it (and the port proves
# it back, as its owner's id); `tls` None means plain TCP, else a *server* context
# (kvpool.security.tls.TLSConfig.server_context).
@dataclass(frozen=True, slots=True)
class ServeSettings:
    """The timeout, credential and TLS context of a listening end (a data port)."""

    timeout_s: float = 10.0
    credential: Credential | None = None
    tls: ssl.SSLContext | None = None


#: plain TCP, no handshake, 10 s: how a data port listens when nothing says otherwise
PLAIN_SERVE = ServeSettings()
