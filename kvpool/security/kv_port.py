"""Credentials on the prefill's ``kv_port``: the pool's handshake, for both transports.

With a credential (:func:`kvpool.security.secret.connector_credential`), every
connection to a P rank's ``kv_port`` opens with the handshake of
:mod:`kvpool.security.handshake` (the same one as the master's and the nodes' ports), D
proving the cluster's client key; after it the connection speaks the pull protocol
unchanged, so the pages pay nothing per frame.  The Transfer Engine's control channel is
such a connection; its own data ports are the engine's and take no credential.
"""

from __future__ import annotations

import socket

from kvpool.errors import ConfigError
from kvpool.protocol.codec import Codec
from kvpool.protocol.pull import Refused
from kvpool.security.admission import Admission
from kvpool.security.credentials import Credential
from kvpool.security.secret import ENV_INSECURE, ENV_SECRET_FILE, is_loopback
from kvpool.security.socket_auth import authenticate

__all__ = ["ROLE", "decode_admission", "open_to_prefill", "require_pull_credential"]

#: the handshake role a decode claims: the cluster's client key (a node's own credential
#: cannot pull KV)
ROLE = "client"


# Safe by default: a P whose kv_host is not loopback refuses to start its pull server
# without a credential, unless told "insecure": true (KVPOOL_INSECURE=1), as the master
# refuses without --insecure.
# The connector's settings are the caller's (kvpool.config.kv_transfer, which imports
# this package): only their values come here, so security never imports config.
def require_pull_credential(
    kv_host: str, credential: Credential | None, insecure: bool, *, key: str
) -> None:
    """Refuse a P serving ``kv_host`` beyond loopback without a credential (one line
    naming the fix; ``key`` names the connector), unless ``insecure``."""
    if credential is not None or insecure:
        return
    if is_loopback(kv_host):
        return
    raise ConfigError(
        f"{key}: kv_host {kv_host} is reachable from other hosts and "
        "no credential is configured, so anyone could read this prefill's KV from kv_port; "
        f'set "secret_file" in the node config (or {ENV_SECRET_FILE}) to the cluster secret, '
        f'or set "insecure": true in kv_connector_extra_config ({ENV_INSECURE}=1) to serve '
        "it open"
    )


# A D without a credential is answered Refused("AuthError: ...") in the pull protocol's own
# words (so its load fails with a reason, and vLLM recomputes), a D with a wrong one fails
# the handshake; either way P closes that connection and keeps serving the others.
def decode_admission(
    credential: Credential,
    server_id: str,
    reply_codec: Codec,  # type: ignore[type-arg]
) -> Admission:
    """The handshake a fresh ``kv_port`` connection must pass: the decode proves the
    credential, or is refused in the port's own words."""
    plain = Refused(
        f"AuthError: prefill {server_id} requires a credential: set {ENV_SECRET_FILE} (or "
        '"secret_file" in the node config) to this cluster\'s secret'
    )
    return Admission(credential, server_id, (ROLE,), reply_codec.encode(plain))


def open_to_prefill(
    sock: socket.socket, credential: Credential, client_id: str, timeout_s: float, where: str
) -> None:
    """D's side of the handshake on a fresh connection to prefill ``where``; raises
    AuthError (the load fails, vLLM recomputes) or PeerTimeout."""
    authenticate(sock, credential, ROLE, client_id, timeout_s, f"prefill {where}")
