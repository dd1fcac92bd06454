"""Who may speak to the pool: the cluster secret, the keys derived from it, and their rules.

Every key is derived from the cluster secret with HMAC-SHA256, so no key is ever sent and
none can be turned back into the secret; the rules are beside :class:`Credential`.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass, replace

from kvpool.errors import AuthError, ConfigError

__all__ = [
    "GRANT_OPS",
    "MIN_SECRET_CHARS",
    "NODE_CREDENTIAL_PREFIX",
    "ROLES",
    "TENANT_CREDENTIAL_PREFIX",
    "Credential",
    "check_grant",
    "check_secret",
    "check_tenant_name",
    "key_for",
    "make_grant",
    "tenant_data_key",
]

#: a secret shorter than this is refused (``openssl rand -hex 32`` gives 64)
MIN_SECRET_CHARS = 32
#: fewer distinct characters than this is a pattern, not a secret
_MIN_DISTINCT = 10
#: a node credential's text form: ``kvpool-node:<node id>:<64 hex digits>``
NODE_CREDENTIAL_PREFIX = "kvpool-node:"
#: a tenant credential's text form: ``kvpool-tenant:<tenant>:<64 hex digits>``
TENANT_CREDENTIAL_PREFIX = "kvpool-tenant:"
#: the roles a handshake can claim (appended only: the wire carries the index)
ROLES = ("client", "node", "data", "tenant", "tenant-data")
#: a tenant name: short, printable, no separator the master uses
_TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")

_FIX = "generate one with `openssl rand -hex 32`"


# A secret is checked before it is used (:func:`check_secret`): short or repetitive text is
# refused, because the handshake is only as strong as the secret it proves.
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


def check_tenant_name(name: str, key: str) -> str:
    """``name`` if it can name a tenant, else a ConfigError naming ``key``."""
    if not _TENANT_NAME.match(name):
        raise ConfigError(
            f"{key}: {name!r} is not a tenant name (1-63 letters, digits, '_', '.', '-', "
            "starting with a letter or digit)"
        )
    return name


def _derive(secret: bytes, label: str) -> bytes:
    return hmac.new(secret, label.encode(), hashlib.sha256).digest()


# Rules:
#
# - The *cluster secret* is the operator's credential: whoever holds it may be a client,
#   an operator, or any node.  Every other key is derived from it with HMAC-SHA256, so no
#   key is ever sent and none can be turned back into the secret.
# - A *node key* is ``HMAC(secret, "kvpool node " + node_id)``: it lets its holder be that
#   one node (register, heartbeat, serve its data port) and nothing else, so a node's
#   credential cannot be used to join as another node or to read the pool as a client.
# - A *tenant key* is ``HMAC(secret, "kvpool tenant " + name)``: it lets its holder be a
#   client of the master in tenant ``name`` only (its keys live in that tenant's namespace,
#   which the master, not the client, decides), never an operator and never a node.
# - Each port's handshake uses one key, chosen by the role the peer claims
#   (:func:`key_for`): ``client`` (a client of the master's RPC port), ``node`` (a storage
#   node to the master: the node key of the id it claims), ``data`` (a peer of a node's
#   data port: the node key of the node that serves it), ``tenant`` (a tenant's client of
#   the master: the tenant key of the tenant named as its id), ``tenant-data`` (a tenant's
#   client of a node's data port: that node's *tenant data key*, :func:`tenant_data_key`,
#   which the master hands the tenant with each placement on that node).
# - A tenant's data request carries a *grant* (:func:`make_grant`): the master's word,
#   MACed with the serving node's key, that this tenant may do this one operation on this
#   one range until a wall-clock deadline.  A tenant holds no node key, so it cannot make
#   one; the node checks it (:func:`check_grant`) before it serves a byte.
# - The HTTP endpoints take a bearer token derived from the secret
#   (:meth:`Credential.operator_token`): it can be typed into ``curl`` and, seen on the
#   wire, gives HTTP reads only, never the secret.
#
# While a secret is rotated a credential holds two: text of two lines is the new
# credential, then the *previous* one (:attr:`Credential.previous`).  Servers accept a peer
# proving either; a handshake uses the first one both sides hold
# (:mod:`kvpool.security.handshake`), so processes switch one at a time without a refused
# request (docs/security.md, "Rolling rotation").
@dataclass(frozen=True, slots=True)
class Credential:
    """A cluster secret, one node's key (``node_id`` set, ``secret`` empty), or one
    tenant's key (``tenant`` set, ``secret`` empty)."""

    secret: bytes = b""
    node_id: str = ""
    node_key: bytes = b""
    tenant: str = ""
    tenant_key: bytes = b""
    data_key: bytes = b""  # a tenant's key to one node's data port (tenant_data_key)
    #: the credential being rotated out, still accepted (a file's second line)
    previous: Credential | None = None

    @classmethod
    def parse(cls, text: str, key: str) -> Credential:
        """A credential as written in a file or variable: a node credential
        (``kvpool-node:ID:HEX``) or a cluster secret; a second line is the previous one,
        of the same kind (and node or tenant), during a rotation."""
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
        if (
            new.is_cluster != old.is_cluster
            or new.node_id != old.node_id
            or new.tenant != old.tenant
        ):
            raise ConfigError(
                f"{key}: the two lines are different kinds of credential (or two nodes' or "
                "tenants'); while rotating, line 2 is the previous credential of the same kind"
            )
        return replace(new, previous=old)

    def candidates(self) -> tuple[Credential, ...]:
        """This credential, then the previous one if rotating (each without a previous)."""
        if self.previous is None:
            return (self,)
        return (replace(self, previous=None), self.previous)

    @classmethod
    def _parse_one(cls, text: str, key: str) -> Credential:
        stripped = text.strip()
        if stripped.startswith(TENANT_CREDENTIAL_PREFIX):
            return cls._parse_tenant(stripped, key)
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

    @classmethod
    def _parse_tenant(cls, text: str, key: str) -> Credential:
        tenant, _, hex_key = text[len(TENANT_CREDENTIAL_PREFIX) :].rpartition(":")
        try:
            tenant_key = bytes.fromhex(hex_key)
        except ValueError:
            tenant_key = b""
        if not _TENANT_NAME.match(tenant) or len(tenant_key) != hashlib.sha256().digest_size:
            raise ConfigError(
                f"{key}: a tenant credential is kvpool-tenant:<tenant>:<64 hex digits>; "
                "make one with `kvpool secret tenant-key --tenant NAME`"
            )
        return cls(tenant=tenant, tenant_key=tenant_key)

    @property
    def is_cluster(self) -> bool:
        return bool(self.secret)

    @property
    def is_tenant(self) -> bool:
        return bool(self.tenant_key)

    @property
    def client_role(self) -> str:
        """The role this credential opens a master connection as."""
        return "tenant" if self.is_tenant else "client"

    def tenant_key_of(self, tenant: str) -> bytes:
        """The key of tenant ``tenant``: derived from the secret, or this tenant's own."""
        if self.secret:
            return _derive(self.secret, f"kvpool tenant {tenant}")
        if not self.tenant_key or tenant != self.tenant:
            mine = f"tenant {self.tenant}'s" if self.tenant else f"node {self.node_id}'s"
            raise AuthError(
                f"this credential is {mine} and cannot act for tenant {tenant!r}; use that "
                "tenant's credential (kvpool secret tenant-key --tenant NAME)"
            )
        return self.tenant_key

    def tenant_credential(self, tenant: str) -> str:
        """The text of tenant ``tenant``'s credential (to give that tenant alone)."""
        check_tenant_name(tenant, "--tenant")
        return f"{TENANT_CREDENTIAL_PREFIX}{tenant}:{self.tenant_key_of(tenant).hex()}"

    def node_key_of(self, node_id: str) -> bytes:
        """The key of node ``node_id``: derived from the secret, or this node's own key."""
        if self.secret:
            return _derive(self.secret, f"kvpool node {node_id}")
        if self.tenant_key:
            raise AuthError(
                f"tenant {self.tenant}'s credential cannot act as node {node_id} (nor open"
                " its data port); a tenant is a client of the master only"
            )
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
            kind = "a tenant" if self.tenant_key else "a node"
            raise AuthError(f"{kind} credential has no operator token; use the cluster secret")
        return _derive(self.secret, "kvpool operator").hex()

    def client_key(self) -> bytes:
        if self.tenant_key:
            raise AuthError(
                f"tenant {self.tenant}'s credential is a client only in its tenant: it "
                "connects in role tenant"
            )
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
    if role == "tenant":
        if not _TENANT_NAME.match(client_id):
            raise AuthError(f"{client_id!r} is not a tenant name")
        return credential.tenant_key_of(client_id)
    if role == "tenant-data":
        if not _TENANT_NAME.match(client_id):
            raise AuthError(f"{client_id!r} is not a tenant name")
        if credential.data_key:
            return credential.data_key
        return tenant_data_key(credential.node_key_of(server_id), client_id)
    raise AuthError(f"unknown role {role!r}; one of {', '.join(ROLES)}")


def tenant_data_key(node_key: bytes, tenant: str) -> bytes:
    """Tenant ``tenant``'s key to the data port of the node whose key is ``node_key``."""
    return hmac.new(node_key, f"kvpool tenant-data {tenant}".encode(), hashlib.sha256).digest()


#: the operations a grant may allow: r(ead) and w(rite) of a memory range, and s(sd
#: read) of one object from a node's SSD tier (its subject: :func:`ssd_subject`)
GRANT_OPS = ("r", "w", "s")


def ssd_subject(key: str) -> str:
    """What an SSD read's grant is for in place of a segment id: the object, found by its
    (scoped) key, since the SSD tier keeps one file per key."""
    return f"ssd:{key}"


def _grant_mac(
    node_key: bytes, tenant: str, segment_id: str, op: str, offset: int, length: int, until: int
) -> str:
    text = f"kvpool grant|{tenant}|{segment_id}|{op}|{offset}|{length}|{until}"
    return hmac.new(node_key, text.encode(), hashlib.sha256).hexdigest()


def make_grant(
    node_key: bytes, tenant: str, segment_id: str, op: str, offset: int, length: int, until: int
) -> str:
    """A grant's text, ``op.offset.length.until.mac`` (``until``: wall-clock ms)."""
    mac = _grant_mac(node_key, tenant, segment_id, op, offset, length, until)
    return f"{op}.{offset}.{length}.{until}.{mac}"


def check_grant(
    node_key: bytes,
    tenant: str,
    segment_id: str,
    grant: str,
    op: str,
    offset: int,
    length: int,
    now_ms: int,
) -> None:
    """Raise AuthError unless ``grant`` lets ``tenant`` do ``op`` on ``length`` bytes at
    ``offset`` of ``segment_id`` at wall-clock ``now_ms``."""
    parts = grant.split(".")
    what = f"{'read' if op == 'r' else 'write'} of {length} bytes at {segment_id}+{offset}"
    if len(parts) != 5 or parts[0] not in GRANT_OPS or not all(p.isdigit() for p in parts[1:4]):
        raise AuthError(f"tenant {tenant}: a {what} without a grant from the master")
    g_op, g_off, g_len, g_until = parts[0], int(parts[1]), int(parts[2]), int(parts[3])
    mac = _grant_mac(node_key, tenant, segment_id, g_op, g_off, g_len, g_until)
    if not hmac.compare_digest(mac, parts[4]):
        raise AuthError(f"tenant {tenant}: a {what} with a grant the master did not make")
    if g_op != op or offset < g_off or offset + length > g_off + g_len:
        raise AuthError(f"tenant {tenant}: a {what} outside its grant ({g_op} {g_off}+{g_len})")
    if now_ms > g_until:
        raise AuthError(f"tenant {tenant}: a {what} with an expired grant; ask the master again")
