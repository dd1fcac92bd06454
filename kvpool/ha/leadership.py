"""What a master is in its cluster, and which requests it may answer (pure: time is a
parameter).  The rules are on :class:`Leadership`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvpool.errors import NotLeader
from kvpool.protocol import messages as m
from kvpool.protocol.data import Error, error_reply

__all__ = ["NODE_REQUESTS", "Leadership"]

#: what a node sends to (re)join: served by a warming leader
NODE_REQUESTS = (m.Register, m.AddSegment, m.Restore, m.Heartbeat)


@dataclass
class Leadership:
    """This master's role; :meth:`answer` gates every request before the service.

    - A master without an election (``ha`` off) always leads, as ``single``, epoch 0.
    - An HA master starts as a standby.  It leads only between :meth:`elected` and the
      end of its lease as last renewed (``valid_until``, on the caller's monotonic
      clock, set short of etcd's own expiry), and never again once it :meth:`lost` it:
      a master that stopped leading leaves (its supervisor starts it again as a fresh
      standby), so no stale index ever serves.
    - Any master answers ``WhoLeads``.  A standby refuses everything else with
      ``NOT_LEADER``, so a client never acts on a standby's index.
    - A new leader first waits for the nodes the previous one knew (etcd lists them)
      to re-announce their catalogs: until each has, or ``warmup_s`` passed, it serves
      nodes only, and clients are refused with ``NOT_LEADER`` (they retry), so no put
      lands in an extent a node has not re-announced yet.
    """

    address: str  # how clients reach this master (its RPC address)
    ha: bool = False
    role: str = "single"  # "single", "standby", "leader", or "gone" once it stopped leading
    epoch: int = 0  # the leader's (this one's while it leads)
    leader: str = ""
    valid_until: float = math.inf
    warming: set[str] = field(default_factory=set)  # node ids not re-announced yet
    warm_until: float = 0.0
    standbys: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.ha:
            self.role, self.valid_until, self.leader = "standby", 0.0, ""
        else:
            self.leader = self.address

    # ---------------------------------------------------------------------- transitions
    def elected(
        self, epoch: int, valid_until: float, nodes: set[str], now: float, warmup_s: float
    ) -> None:
        """This master won ``epoch``; its lease holds until ``valid_until``; ``nodes`` the
        previous leader knew must re-announce first (for at most ``warmup_s``)."""
        self.role, self.epoch, self.leader = "leader", epoch, self.address
        self.valid_until = valid_until
        self.warming = set(nodes)
        self.warm_until = now + warmup_s

    def renewed(self, valid_until: float) -> None:
        if self.role == "leader":
            self.valid_until = valid_until

    def follow(self, leader: str, epoch: int, standbys: list[str]) -> None:
        """What etcd says of the others (a standby's view; ``leader`` "" while none)."""
        if self.role == "standby":
            self.leader, self.epoch = leader, epoch
        self.standbys = [s for s in standbys if s != self.leader]

    def lost(self) -> None:
        """The lease ended (or could not be renewed in time): this master stops leading
        for good."""
        self.role, self.valid_until, self.leader = "gone", 0.0, ""

    # ------------------------------------------------------------------------- queries
    def leading(self, now: float) -> bool:
        return self.role == "single" or (self.role == "leader" and now < self.valid_until)

    def warm(self, now: float) -> bool:
        return not self.warming or now >= self.warm_until

    def who(self, now: float) -> m.LeaderInfo:
        role = self.role if self.role != "leader" or self.leading(now) else "gone"
        leader = self.leader if role in ("single", "leader", "standby") else ""
        return m.LeaderInfo(
            role,
            self.epoch,
            leader,
            self.address,
            warming=0 if self.warm(now) else len(self.warming),
            standbys=list(self.standbys),
        )

    # ------------------------------------------------------------------------ the gate
    def answer(self, request: m.MasterRequest, now: float) -> m.MasterReply | None:
        """The reply this master gives instead of serving ``request``, or None: serve it."""
        if type(request) is m.WhoLeads:
            return self.who(now)
        if self.role == "single":
            return None
        if not self.leading(now):
            where = f"; the leader is {self.leader}" if self.leader else "; no master leads now"
            return _refusal(f"{self.address} is not the leader ({self.role}){where}")
        if self.warming and not isinstance(request, (*NODE_REQUESTS, m.Stats)):
            if now < self.warm_until:
                return _refusal(
                    f"{self.address} leads epoch {self.epoch} and waits for "
                    f"{len(self.warming)} node(s) to re-announce; retry"
                )
            self.warming.clear()
        return None

    def served(self, request: m.MasterRequest, reply: m.MasterReply) -> str | None:
        """After the service answered: a node that finished re-announcing leaves the
        warm-up set.  Returns the id of a storage owner that registered (the caller
        records it in etcd, for the next leader's warm-up)."""
        if isinstance(reply, Error):
            return None
        if isinstance(request, m.Register):
            return request.client_id if request.data_address else None
        # a node re-announces its SSD tier and memory catalog inside its registration
        # (its memory's Restore ends with done) and heartbeats only after: either says
        # it is through
        if self.warming and (
            (isinstance(request, m.Restore) and request.done) or isinstance(request, m.Heartbeat)
        ):
            self.warming.discard(request.client_id)
        return None


def _refusal(message: str) -> Error:
    return error_reply(NotLeader(message))
