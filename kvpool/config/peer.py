"""How this process dials a peer's port: one value for every connection it opens.

A :class:`PeerSettings` is made once, where the settings are known (a client's
constructor, a node's config, the master's flags), and handed down unchanged to each
link and data path that opens a socket: the master link, a node's data connection, the
master's own links to nodes.  So those four settings travel together and are never
passed, or forgotten, one by one.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from kvpool.security.credentials import Credential

__all__ = ["PLAIN_PEER", "PeerSettings"]


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
