"""The master's metadata messages (control plane).  Bytes never travel here; the data
plane's ``Error`` is every request's other possible reply.
"""

from __future__ import annotations

import msgspec

from kvpool.protocol.codec import Codec
from kvpool.protocol.data import Error, Ok

__all__ = [
    "MASTER_REPLY_CODEC",
    "MASTER_REQUEST_CODEC",
    "AddSegment",
    "BatchExists",
    "BatchGet",
    "BatchPutEnd",
    "BatchPutStart",
    "Bools",
    "Count",
    "Error",
    "Exists",
    "Get",
    "Heartbeat",
    "HeartbeatReply",
    "LeaderInfo",
    "MasterReply",
    "MasterRequest",
    "Ok",
    "Pin",
    "Placement",
    "Placements",
    "PrefixLookup",
    "PutEnd",
    "PutRevoke",
    "PutStart",
    "Register",
    "RegisterReply",
    "Release",
    "ReleaseOwner",
    "Remove",
    "ReportCorrupt",
    "ReportFailure",
    "Restore",
    "SetQuota",
    "Stats",
    "StatsReply",
    "WarmthReport",
    "WhoLeads",
]


# Conversation on one connection: strictly request → reply, one at a time.  Every reply is
# the request's own reply type, or :class:`~kvpool.protocol.data.Error`.
#
#     Register / AddSegment / Heartbeat / Restore      a storage owner (node or client) joins
#     PutStart → Placement ; PutEnd ; PutRevoke        two-phase write
#     Get → Placement (with a read lease) ; Release    read
#     Exists / BatchExists / PrefixLookup              probes: never lease
#     WhoLeads → LeaderInfo                            which master leads (any answers)
#     Remove ; Pin ; ReleaseOwner                      holds and removal
#     ReportFailure                                    a transfer to a segment failed
#     ReportCorrupt                                    a copy failed its checksum
#     Stats                                            pool at a glance (kvpool status)
#     SetQuota                                         a tenant's byte quota (operator only)
class Register(msgspec.Struct, frozen=True, tag=True):
    client_id: str
    data_address: str = ""  # host:port of the owner's segment data server, if any
    host_token: str = ""


class RegisterReply(msgspec.Struct, frozen=True, tag=True):
    new: bool
    client_ttl_ms: int
    heartbeat_interval_ms: int


class AddSegment(msgspec.Struct, frozen=True, tag=True):
    client_id: str
    segment_id: str
    capacity: int
    tier: str = "memory"
    shm_name: str = ""
    # the owner re-announces objects it holds in this segment (Restore) before any new
    # put may be placed there; its last Restore says ``done``
    restoring: bool = False
    # how far its pages are faulted in: off / warming / warm / failed ("": not said),
    # and the bytes done; a heartbeat carries the changes (``Heartbeat.warmth``)
    warm: str = ""
    warmed: int = 0


#: (segment_id, warm state, bytes warmed), as in ``AddSegment.warm`` / ``warmed``
WarmthReport = tuple[str, str, int]


class Heartbeat(msgspec.Struct, frozen=True, tag=True):
    client_id: str
    # the sender's segments whose warmth changed since it last said (for kvpool status)
    warmth: list[WarmthReport] = []


class HeartbeatReply(msgspec.Struct, frozen=True, tag=True):
    """What changed in the sender's segments since its last heartbeat, so a node keeps a
    catalog of what it holds and can re-announce it to a restarted master."""

    added: list[tuple[str, str, int, int, int]]  # key, segment_id, offset, size, checksum
    removed: list[str]


class Restore(msgspec.Struct, frozen=True, tag=True):
    """Objects a node still holds after the master restarted: (key, offset, size, checksum).

    For an SSD segment ``offset`` is ignored (files are found by key).  Senders split a
    large announcement into messages of a few thousand objects, far below the frame limit."""

    client_id: str
    segment_id: str
    objects: list[tuple[str, int, int, int]]
    done: bool = False  # the last one: the segment takes new puts from now on


class PutStart(msgspec.Struct, frozen=True, tag=True):
    client_id: str
    key: str
    size: int
    parent: str | None = None
    replica_num: int = 0  # copies wanted, each on another node (0: the master's default)


class BatchPutStart(msgspec.Struct, frozen=True, tag=True):
    client_id: str
    keys: list[str]
    sizes: list[int]
    #: each key's parent block (the eviction policy trims a prefix from its tail); empty
    #: when none has one
    parents: list[str | None] = []
    replica_num: int = 0  # as PutStart's, for every key


class PutEnd(msgspec.Struct, frozen=True, tag=True):
    """``noted``: the value went to its node with its key and checksum (a tagged
    ``SegmentWrite``), so the node already holds the catalog entry and the reply need
    not wait for the node to confirm it."""

    client_id: str
    key: str
    checksum: int
    noted: bool = False
    #: segments of the reservation's copies that could not be written (those go)
    unwritten: list[str] = []


class BatchPutEnd(msgspec.Struct, frozen=True, tag=True):
    """``noted``: as :class:`PutEnd`'s, for every key of the batch."""

    client_id: str
    keys: list[str]
    checksums: list[int]
    noted: bool = False
    unwritten: list[list[str]] = []  # per key, as PutEnd's (empty: every copy written)


class PutRevoke(msgspec.Struct, frozen=True, tag=True):
    client_id: str
    key: str


class Get(msgspec.Struct, frozen=True, tag=True):
    owner: str
    key: str


class BatchGet(msgspec.Struct, frozen=True, tag=True):
    owner: str
    keys: list[str]


class Release(msgspec.Struct, frozen=True, tag=True):
    owner: str
    keys: list[str]


class ReleaseOwner(msgspec.Struct, frozen=True, tag=True):
    owner: str


class Pin(msgspec.Struct, frozen=True, tag=True):
    owner: str
    keys: list[str]
    ttl_ms: int


class Exists(msgspec.Struct, frozen=True, tag=True):
    key: str


class BatchExists(msgspec.Struct, frozen=True, tag=True):
    keys: list[str]


class PrefixLookup(msgspec.Struct, frozen=True, tag=True):
    keys: list[str]
    tokens_per_key: int = 0  # lets the master count hit tokens, not just blocks


class Remove(msgspec.Struct, frozen=True, tag=True):
    key: str


class ReportFailure(msgspec.Struct, frozen=True, tag=True):
    """A transfer to ``segment_id`` failed: the master drops its owner at once."""

    segment_id: str
    reason: str


class ReportCorrupt(msgspec.Struct, frozen=True, tag=True):
    """The copy of ``key`` at ``segment_id``/``offset`` (recorded with ``checksum``)
    failed its checksum on a read, or its owner said it has no such copy: the master
    drops that copy -- only that one (a copy
    stored since, elsewhere or with another checksum, stays) -- so the key can be stored
    again."""

    key: str
    segment_id: str
    offset: int
    checksum: int


class Stats(msgspec.Struct, frozen=True, tag=True):
    pass


class SetQuota(msgspec.Struct, frozen=True, tag=True):
    """Set tenant ``tenant``'s byte quota (0: none); the cluster secret's connections only.
    Replies :class:`Count`: the tenant's bytes held now."""

    tenant: str
    quota_bytes: int


# A :class:`Placement` names the segment and how to reach it: the owner's data address for
# TCP and, for clients on the same host (equal ``host_token``), its shared-memory name.
class Placement(msgspec.Struct, frozen=True, tag=True, rename={"placed": "found"}):
    """Where an object is (a get) or is to be written (a put).

    ``placed`` says whether the master gave a place at all.  False means, for a get, a
    miss; for a put, nothing to write: the key is already stored (or, in a batch, refused:
    see ``error``).  On the wire the field keeps its first name, ``found``.
    """

    placed: bool
    key: str = ""
    segment_id: str = ""
    tier: str = "memory"
    offset: int = 0
    size: int = 0
    checksum: int = 0
    data_address: str = ""
    shm_name: str = ""
    host_token: str = ""
    error: str = ""  # in a batch: the error code that refused this key ("" if none)
    #: a put: the other copies to write the same bytes to (replica_num > 1)
    replicas: list[Placement] = []
    #: a get: how many copies the object has; a reader whose copy failed reports it
    #: and asks again, for another
    copies: int = 1


class Placements(msgspec.Struct, frozen=True, tag=True):
    items: list[Placement]


class Bools(msgspec.Struct, frozen=True, tag=True):
    values: list[bool]


class Count(msgspec.Struct, frozen=True, tag=True):
    value: int


class StatsReply(msgspec.Struct, frozen=True, tag=True):
    """Everything `kvpool status` and the status page show (a JSON-able dict)."""

    snapshot: dict[str, object]


class WhoLeads(msgspec.Struct, frozen=True, tag=True):
    """Which master leads?  Any master answers it, leader or not: an HA link asks on
    each new connection and after every ``NOT_LEADER`` refusal."""


# Its wire tag keeps the name it was first sent under; the class is named apart from
# kvpool.ha.leadership.Leadership, the master's own gate that answers with it.
class LeaderInfo(msgspec.Struct, frozen=True, tag="Leadership"):
    """A master's answer to :class:`WhoLeads`."""

    role: str  # "leader", "standby", or "single" (no election: it always leads)
    epoch: int  # the leader's term: etcd's create revision of its leader key (0: single)
    leader: str  # the leader's RPC address as clients reach it ("" while none leads)
    address: str  # this master's own
    warming: int = 0  # nodes a new leader still waits for before it serves clients
    standbys: list[str] = []


MasterRequest = (
    Register
    | AddSegment
    | Heartbeat
    | Restore
    | PutStart
    | BatchPutStart
    | PutEnd
    | BatchPutEnd
    | PutRevoke
    | Get
    | BatchGet
    | Release
    | ReleaseOwner
    | Pin
    | Exists
    | BatchExists
    | PrefixLookup
    | Remove
    | ReportFailure
    | ReportCorrupt
    | Stats
    | SetQuota
    | WhoLeads
)
MasterReply = (
    RegisterReply
    | HeartbeatReply
    | Placement
    | Placements
    | Bools
    | Count
    | StatsReply
    | Ok
    | LeaderInfo
    | Error
)

# Built once: msgspec decoders are compiled per type.

MASTER_REQUEST_CODEC: Codec[MasterRequest] = Codec(MasterRequest)
MASTER_REPLY_CODEC: Codec[MasterReply] = Codec(MasterReply)
