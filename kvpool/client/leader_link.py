"""A link to whichever of several masters leads, followed across failovers.

Any listed master (or etcd) finds the leader; a ``NOT_LEADER`` refusal or a failed
connection sends the link back to finding it, and the request is sent again until
``failover_s``: a failover costs a delay, not an error.  A master claiming an epoch older
than one seen is never used again (fencing).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable

from kvpool.client.master_link import MasterLink, TcpMasterLink
from kvpool.config.masters import ETCD_SCHEME, Masters, parse_masters
from kvpool.errors import KVPoolError, NotLeader, PeerTimeout, TransferError
from kvpool.ha.campaign import ClusterKeys
from kvpool.ha.etcd import Etcd, parse_endpoints
from kvpool.protocol import messages as m
from kvpool.protocol.data import Error
from kvpool.security.peer import PLAIN_PEER, PeerSettings

__all__ = ["FAILOVER_S", "LeaderLink", "master_link"]

log = logging.getLogger("kvpool.client")

#: how long one call waits for a leader at least (a lease's TTL, plus the warm-up)
FAILOVER_S = 20.0
#: between two rounds of asking the masters
RETRY_S = 0.1
#: a master silent this long is given up for another: a frozen or cut-off leader stops
#: leading within its lease's TTL anyway, and every master reply (a node's held
#: heartbeat included) comes sooner than this from a live one
CALL_TIMEOUT_S = 4.0
#: a master that failed to answer is asked last for this long: a cut-off leader would
#: cost every round of the search its whole timeout
DOWN_S = 10.0


def master_link(
    master: str, peer: PeerSettings = PLAIN_PEER, *, role: str = "client"
) -> MasterLink:
    """The link for a master address (:mod:`kvpool.config.masters`): one TCP link for
    one master, a :class:`LeaderLink` for HA masters."""
    if "," not in master and not master.strip().startswith(ETCD_SCHEME):
        return TcpMasterLink(master, peer, role=role)  # one master, taken as it is written
    return LeaderLink(parse_masters(master, key="master"), peer, role=role)


# Resending is safe because nothing was done: a standby refuses before serving, and a
# master whose connection died with a request in flight was the old leader, whose
# index is gone with it (a master that stops leading exits).
class LeaderLink:
    """Follows the leader of ``masters``; thread-safe (each master's link serialises
    its calls; the leader's address is swapped under a lock)."""

    pipelined = True

    def __init__(
        self,
        masters: Masters,
        peer: PeerSettings = PLAIN_PEER,
        *,
        role: str = "client",
        failover_s: float | None = None,
    ) -> None:
        self.masters, self.role = masters, role
        self.peer = dataclasses.replace(peer, timeout_s=min(peer.timeout_s, CALL_TIMEOUT_S))
        self.address = str(masters)
        self.failover_s = FAILOVER_S if failover_s is None else failover_s
        self.epoch = 0  # the highest a leader has shown this link
        self.leader: str | None = None
        self._links: dict[str, TcpMasterLink] = {}
        self._lock = threading.Lock()
        self._etcd = Etcd(parse_endpoints(",".join(masters.etcd))) if masters.etcd else None
        self.failovers = 0  # times the leader it used went away
        self._down: dict[str, float] = {}  # address -> until when it is asked last

    # ------------------------------------------------------------------------ MasterLink
    def call(
        self, request: m.MasterRequest, meanwhile: Callable[[], object] | None = None
    ) -> m.MasterReply:
        deadline = time.monotonic() + self.failover_s
        ran = [meanwhile is None]

        def once() -> object:
            ran[0] = True
            assert meanwhile is not None
            return meanwhile()

        while True:
            address = self._find(deadline)
            link = self._link(address)
            try:
                reply = link.call(request, None if ran[0] else once)
            except (TransferError, PeerTimeout) as exc:
                self._lost(address, str(exc))
            else:
                if not (isinstance(reply, Error) and reply.code == NotLeader.code):
                    return reply
                self._refused(address, link)
            if time.monotonic() >= deadline:
                raise TransferError(f"no master of {self.address} led within {self.failover_s:g}s")
            time.sleep(RETRY_S)

    def post(self, request: m.MasterRequest) -> None:
        leader = self.leader
        if leader is not None:
            self._link(leader).post(request)

    def close(self) -> None:
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()

    # ----------------------------------------------------------------- the leader's search
    def _link(self, address: str) -> TcpMasterLink:
        with self._lock:
            link = self._links.get(address)
            if link is None:
                link = self._links[address] = TcpMasterLink(address, self.peer, role=self.role)
            return link

    def _lost(self, address: str, why: str) -> None:
        with self._lock:
            self._down[address] = time.monotonic() + DOWN_S
            if self.leader == address:
                self.leader = None
                self.failovers += 1
                log.warning("the master at %s is gone (%s): looking for the leader", address, why)

    def _refused(self, address: str, link: TcpMasterLink) -> None:
        """NOT_LEADER: a standby (go elsewhere), or the leader warming up (stay)."""
        try:
            who = link.call(m.WhoLeads())
        except KVPoolError:
            who = None
        if isinstance(who, m.LeaderInfo) and who.role == "leader" and who.epoch >= self.epoch:
            return  # warming up: the same master, again shortly
        self._lost(address, "it does not lead")

    def _find(self, deadline: float) -> str:
        while True:
            leader = self.leader
            if leader is not None:
                return leader
            found = self._search()
            if found is not None:
                with self._lock:
                    self.leader = found
                return found
            if time.monotonic() >= deadline:
                raise TransferError(
                    f"no master of {self.address} leads (asked within {self.failover_s:g}s)"
                )
            time.sleep(RETRY_S)

    def _search(self) -> str | None:
        """One round: etcd's leader key, or each master's answer (a standby's hint first)."""
        candidates = list(self.masters.addresses)
        if self._etcd is not None:
            try:
                kv = self._etcd.get(ClusterKeys(self.masters.cluster_id).leader)
            except KVPoolError as exc:
                log.debug("etcd: %s", exc)
                kv = None
            if kv is not None:
                candidates = [json.loads(kv.value).get("address", "")]
        now = time.monotonic()
        down = {a for a, until in self._down.items() if until > now}
        candidates.sort(key=lambda a: a in down)  # the silent ones last
        asked: set[str] = set()
        while candidates:
            address = candidates.pop(0)
            if not address or address in asked:
                continue
            asked.add(address)
            try:
                who = self._link(address).call(m.WhoLeads())
            except KVPoolError:
                with self._lock:
                    self._down[address] = time.monotonic() + DOWN_S
                continue
            if not isinstance(who, m.LeaderInfo):
                continue
            if who.role in ("leader", "single"):
                if who.epoch < self.epoch:
                    log.warning(
                        "%s claims epoch %d, older than %d: a stale leader, not used",
                        address, who.epoch, self.epoch,
                    )  # fmt: skip
                    continue
                self.epoch = who.epoch
                self._down.pop(address, None)
                return address
            if who.leader and who.leader not in down:  # a hint of a silent one waits
                candidates.insert(0, who.leader)
        return None
