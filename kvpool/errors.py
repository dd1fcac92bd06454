"""The one error hierarchy of kvpool.

Everything kvpool raises on purpose is a :class:`KVPoolError` (whose docstring draws the
tree).  Errors cross the wire as ``(code, message)`` pairs; :func:`error_from_code` turns
a pair back into the same class on the client side.
"""

from __future__ import annotations

__all__ = [
    "AuthError",
    "ChecksumMismatch",
    "ConfigError",
    "KVPoolError",
    "NoSpace",
    "NotLeader",
    "ObjectBusy",
    "ObjectNotFound",
    "Overloaded",
    "PeerTimeout",
    "PoolError",
    "ProtocolError",
    "QuotaExceeded",
    "StaleWrite",
    "TransferError",
    "UnknownClient",
    "UnknownSegment",
    "WriteConflict",
    "error_code",
    "error_from_code",
]


class KVPoolError(Exception):
    """Base of every error kvpool raises on purpose.

    The whole family::

        KVPoolError
        ├── ConfigError            bad config file, flag or environment value (names the key)
        ├── ProtocolError          malformed, oversized or unknown wire frame
        ├── PoolError              a request the pool understood but could not honour
        │   ├── NoSpace            no room even after evicting everything evictable
        │   │   └── QuotaExceeded  the tenant's byte quota, even after evicting its own objects
        │   ├── ObjectNotFound     no READY object under that key (a miss)
        │   ├── ObjectBusy         leased or pinned, so it cannot be removed now
        │   ├── WriteConflict      another writer holds the key PENDING
        │   ├── StaleWrite         put_end/put_revoke for a reservation that is gone
        │   ├── UnknownClient      a client id the registry does not know (expired?)
        │   ├── UnknownSegment     a segment id the registry does not know
        │   ├── Overloaded         a server at its connection or buffer limit: retry later
        │   └── NotLeader          a standby master, or a new leader still warming up
        ├── AuthError              no credential, a wrong one, or one that may not do this
        ├── TransferError          moving bytes failed (peer gone, short read, bad checksum)
        │   └── ChecksumMismatch   the bytes read are not the bytes written: treat as a miss
        └── PeerTimeout            a peer did not answer in time (never a hang)
    """

    code = "KVPOOL_ERROR"


class ConfigError(KVPoolError):
    """A config value is missing, unknown or invalid; the message names the key and the fix."""

    code = "CONFIG"


class ProtocolError(KVPoolError):
    """A frame could not be decoded, was too large, or named an unknown message type."""

    code = "PROTOCOL"


class PoolError(KVPoolError):
    """The pool understood the request but cannot honour it."""

    code = "POOL"


class NoSpace(PoolError):
    """No segment can hold the object, even after evicting every evictable object."""

    code = "NO_SPACE"


class QuotaExceeded(NoSpace):
    """The put would take its tenant over its byte quota, even after evicting every
    evictable object of that tenant (never another tenant's).  A NoSpace, so a caller
    that skips a put on a full pool skips this one alike."""

    code = "QUOTA_EXCEEDED"


class ObjectNotFound(PoolError):
    """No READY object under this key: a cache miss."""

    code = "NOT_FOUND"


class ObjectBusy(PoolError):
    """The object is leased or pinned and cannot be removed now."""

    code = "BUSY"


class WriteConflict(PoolError):
    """Another writer is writing this key (it is PENDING)."""

    code = "WRITE_CONFLICT"


class StaleWrite(PoolError):
    """put_end/put_revoke for a reservation that expired or was revoked."""

    code = "STALE_WRITE"


class UnknownClient(PoolError):
    """The client id is not registered (it may have expired after client_ttl)."""

    code = "UNKNOWN_CLIENT"


class UnknownSegment(PoolError):
    """The segment id is not registered."""

    code = "UNKNOWN_SEGMENT"


class Overloaded(PoolError):
    """A server is at one of its limits (connections, buffered request bytes) and refused
    this peer; nothing about the peer or its data is wrong, so it may retry later."""

    code = "OVERLOADED"


class NotLeader(PoolError):
    """This master does not serve the request: it is a standby, or a leader still
    waiting for its nodes to re-announce.  An HA client asks it who leads and retries
    there; nothing was done."""

    code = "NOT_LEADER"


class AuthError(KVPoolError):
    """A peer without a credential, with a wrong one, or claiming what its credential does
    not cover (another node's id); the connection is closed after the refusal.  Not a
    PoolError: retrying the same request cannot succeed until the credential changes."""

    code = "AUTH"


class TransferError(KVPoolError):
    """Bytes could not be moved between a client and a segment."""

    code = "TRANSFER"


class ChecksumMismatch(TransferError):
    """The bytes read do not match the checksum recorded at write time."""

    code = "CHECKSUM"


class PeerTimeout(KVPoolError):
    """A peer did not answer within its configured timeout."""

    code = "TIMEOUT"


def _wire_table() -> dict[str, type[KVPoolError]]:
    """Wire code → class, for every class of the tree above that names its own code.

    Derived from the classes, so a new error is on the wire the moment it is written; a
    subclass elsewhere that keeps its parent's code (a private refinement) crosses the
    wire as that parent.  Two classes with one code would make the table ambiguous."""
    table: dict[str, type[KVPoolError]] = {}
    todo: list[type[KVPoolError]] = [KVPoolError]
    while todo:
        cls = todo.pop(0)
        todo.extend(cls.__subclasses__())
        if "code" not in vars(cls):
            continue
        if cls.code in table:
            raise TypeError(f"{cls.__name__} and {table[cls.code].__name__} share {cls.code}")
        table[cls.code] = cls
    return table


_BY_CODE: dict[str, type[KVPoolError]] = _wire_table()


def error_code(exc: BaseException) -> str:
    """The wire code of an exception; anything not ours is an internal error."""
    return exc.code if isinstance(exc, KVPoolError) else "INTERNAL"


def error_from_code(code: str, message: str) -> KVPoolError:
    """Rebuild the error a peer reported; an unknown code becomes the base class."""
    return _BY_CODE.get(code, KVPoolError)(message)
