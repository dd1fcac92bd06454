"""Who may speak to the pool: the cluster secret, the keys derived from it, and their rules.

Rules:

- The *cluster secret* is the operator's credential: whoever holds it may be a client,
  an operator, or any node.  Every other key is derived from it with HMAC-SHA256, so no
  key is ever sent and none can be turned back into the secret.
- A *node key* is ``HMAC(secret, "kvpool node " + node_id)``: it lets its holder be that
  one node (register, heartbeat, serve its data port) and nothing else, so a node's
  credential cannot be used to join as another node or to read the pool as a client.
- Each port's handshake uses one key, chosen by the role the peer claims
  (:func:`key_for`): ``client`` (a client of the master's RPC port), ``node`` (a storage
  node to the master: the node key of the id it claims), ``data`` (a peer of a node's
  data port: the node key of the node that serves it).
- The HTTP endpoints take a bearer token derived from the secret
  (:meth:`Credential.operator_token`): it can be typed into ``curl`` and, seen on the
  wire, gives HTTP reads only, never the secret.

A secret is checked before it is used (:func:`check_secret`): short or repetitive text is
refused, because the handshake is only as strong as the secret it proves.

While a secret is rotated a credential holds two: text of two lines is the new
credential, then the *previous* one (:attr:`Credential.previous`).  Servers accept a peer
proving either; a handshake uses the first one both sides hold
(:mod:`kvpool.protocol.auth`), so processes switch one at a time without a refused
request (docs/security.md, "Rolling rotation").
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from kvpool.errors import AuthError, ConfigError

__all__ = [
    "MIN_SECRET_CHARS",
    "NODE_CREDENTIAL_PREFIX",
    "ROLES",
    "Credential",
    "check_secret",
    "key_for",
]

#: a secret shorter than this is refused (``openssl rand -hex 32`` gives 64)
MIN_SECRET_CHARS = 32
#: fewer distinct characters than this is a pattern, not a secret
_MIN_DISTINCT = 10
#: a node credential's text form: ``kvpool-node:<node id>:<64 hex digits>``
NODE_CREDENTIAL_PREFIX = "kvpool-node:"
#: the roles a handshake can claim
ROLES = ("client", "node", "data")

_FIX = "generate one with `openssl rand -hex 32`"


def check_secret(text: str, key: str) -> bytes:
    """The secret's bytes, or a ConfigError naming ``key`` (where it came from) and the fix."""
    secret = text.strip()
    if not secret:
        raise ConfigError(f"{key}: the secret is empty; {_FIX}")
    if len(secret) < MIN_SECRET_CHARS:
        raise ConfigError(
            f"{key}: the secret has {len(secret)} characters, at least {MIN_SECRET_CHARS} "
            f"are needed; {_FIX}"
        )
    if len(set(secret)) < _MIN_DISTINCT:
        raise ConfigError(f"{key}: the secret is a repeated pattern, not a secret; {_FIX}")
    return secret.encode()


def _derive(secret: bytes, label: str) -> bytes:
    return hmac.new(secret, label.encode(), hashlib.sha256).digest()


@dataclass(frozen=True, slots=True)
class Credential:
    """A cluster secret, or one node's key (``node_id`` set, ``secret`` empty)."""

    secret: bytes = b""
    node_id: str = ""
    node_key: bytes = b""
    #: the credential being rotated out, still accepted (a file's second line)
    previous: Credential | None = None

    @classmethod
    def parse(cls, text: str, key: str) -> Credential:
        """A credential as written in a file or variable: a node credential
        (``kvpool-node:ID:HEX``) or a cluster secret; a second line is the previous one,
        of the same kind (and node), during a rotation."""
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if len(lines) <= 1:
            return cls._parse_one(lines[0] if lines else "", key)
        if len(lines) > 2:
            raise ConfigError(
                f"{key}: {len(lines)} lines; a credential is one line, or two while rotating "
                "(the new one, then the previous one)"
            )
        new, old = (
            cls._parse_one(lines[0], f"{key} line 1"),
            cls._parse_one(lines[1], f"{key} line 2"),
        )
        if new.is_cluster != old.is_cluster or new.node_id != old.node_id:
            raise ConfigError(
                f"{key}: the two lines are different kinds of credential (or two nodes'); "
                "while rotating, line 2 is the previous credential of the same kind"
            )
        return cls(new.secret, new.node_id, new.node_key, previous=old)

    def candidates(self) -> tuple[Credential, ...]:
        """This credential, then the previous one if rotating (each without a previous)."""
        if self.previous is None:
            return (self,)
        return (Credential(self.secret, self.node_id, self.node_key), self.previous)

    @classmethod
    def _parse_one(cls, text: str, key: str) -> Credential:
        stripped = text.strip()
        if not stripped.startswith(NODE_CREDENTIAL_PREFIX):
            return cls(secret=check_secret(stripped, key))
        node_id, _, hex_key = stripped[len(NODE_CREDENTIAL_PREFIX) :].rpartition(":")
        try:
            node_key = bytes.fromhex(hex_key)
        except ValueError:
            node_key = b""
        if not node_id or len(node_key) != hashlib.sha256().digest_size:
            raise ConfigError(
                f"{key}: a node credential is kvpool-node:<node id>:<64 hex digits>; "
                "make one with `kvpool secret node-key --node-id ID`"
            )
        return cls(node_id=node_id, node_key=node_key)

    @property
    def is_cluster(self) -> bool:
        return bool(self.secret)

    def node_key_of(self, node_id: str) -> bytes:
        """The key of node ``node_id``: derived from the secret, or this node's own key."""
        if self.secret:
            return _derive(self.secret, f"kvpool node {node_id}")
        if node_id != self.node_id:
            raise AuthError(
                f"this credential is node {self.node_id}'s and cannot act for {node_id}; "
                "use that node's credential (or the cluster secret)"
            )
        return self.node_key

    def node_credential(self, node_id: str) -> str:
        """The text of node ``node_id``'s credential (to give that node alone)."""
        return f"{NODE_CREDENTIAL_PREFIX}{node_id}:{self.node_key_of(node_id).hex()}"

    def operator_token(self) -> str:
        """The bearer token of the master's HTTP endpoints."""
        if not self.secret:
            raise AuthError("a node credential has no operator token; use the cluster secret")
        return _derive(self.secret, "kvpool operator").hex()

    def client_key(self) -> bytes:
        if not self.secret:
            raise AuthError(
                f"node {self.node_id}'s credential cannot be a client; use the cluster secret"
            )
        return _derive(self.secret, "kvpool client")


def key_for(credential: Credential, role: str, client_id: str, server_id: str) -> bytes:
    """The key a handshake in ``role`` proves, between ``client_id`` and ``server_id``."""
    if role == "client":
        return credential.client_key()
    if role == "node":
        return credential.node_key_of(client_id)
    if role == "data":
        return credential.node_key_of(server_id)
    raise AuthError(f"unknown role {role!r}; one of {', '.join(ROLES)}")
