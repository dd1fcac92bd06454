"""A master's campaign for leadership on etcd, in a thread of its own.

Under ``/kvpool/<cluster_id>/``: ``leader`` (on its lease), ``masters/<address>`` (each on
its own lease) and ``nodes/<id>`` (no lease: a new leader waits for them to re-announce).
A leader's epoch is its ``leader`` key's create revision, which only grows.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvpool.errors import KVPoolError
from kvpool.ha.etcd import Etcd

__all__ = ["Campaign", "ClusterKeys", "Elected", "etcd_timeout_s"]

log = logging.getLogger("kvpool.ha")

#: how often a standby looks whether the leader key is gone (and the least a failed
#: renewal waits before it is tried again)
POLL_S = 0.2


def etcd_timeout_s(ttl_s: int) -> float:
    """How long one etcd call may take, per endpoint.  Safety does not depend on it (a
    leader counts its lease from when a renewal was *sent*, and the gate stops serving at
    that time whatever the thread is doing), so it is as long as liveness allows: a
    renewal that answers within half the lease still arrives before the lease is over,
    even after one dead endpoint cost a timeout.  etcd on a slow disk or a loaded host
    answers writes in hundreds of milliseconds; a shorter bound elected no one there."""
    return ttl_s / 2


@dataclass(frozen=True, slots=True)
class ClusterKeys:
    cluster_id: str

    @property
    def prefix(self) -> str:
        return f"/kvpool/{self.cluster_id}/"

    @property
    def leader(self) -> str:
        return self.prefix + "leader"

    def master(self, address: str) -> str:
        return self.prefix + "masters/" + address

    def node(self, node_id: str) -> str:
        return self.prefix + "nodes/" + node_id


@dataclass(frozen=True, slots=True)
class Elected:
    epoch: int
    valid_until: float
    nodes: set[str]


# A leader renews its lease every ttl/4 and counts itself the leader only until
# sent + ttl - ttl/4 after the last renewal etcd acknowledged (sent: when that renewal
# was sent).  etcd expires the lease no earlier than ttl after it received that
# renewal, so the old leader has stopped before any other master can win: there is
# never a moment with two.
class Campaign:
    """Runs until :meth:`stop`: campaigns, renews, and reports through the callbacks
    (called on this thread): ``on_elected``, ``on_renewed(valid_until)``,
    ``on_view(leader, epoch, masters)`` and ``on_lost(why)`` (after which it ends)."""

    def __init__(
        self,
        etcd: Etcd,
        keys: ClusterKeys,
        address: str,
        ttl_s: int,
        *,
        on_elected: Callable[[Elected], None],
        on_renewed: Callable[[float], object],
        on_view: Callable[[str, int, list[str]], object],
        on_lost: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.etcd, self.keys, self.address, self.ttl_s = etcd, keys, address, ttl_s
        self.on_elected, self.on_renewed = on_elected, on_renewed
        self.on_view, self.on_lost = on_view, on_lost
        self.clock = clock
        self.lease = 0
        self.leading = False
        self.epoch = 0  # this master's while it leads
        self.valid_until = 0.0
        self._renewed_at = 0.0
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by stop() and node_joined(): act at once
        self._thread: threading.Thread | None = None
        self._pending_nodes: list[tuple[str, str]] = []
        self._gone_nodes: list[str] = []
        self._lock = threading.Lock()
        self.gone = False  # it lost the leadership: the campaign is over

    @property
    def margin_s(self) -> float:
        return self.ttl_s / 4

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvpool-ha", daemon=True)
        self._thread.start()

    def stop(self, *, resign: bool = True) -> None:
        """Stop campaigning; ``resign``: end the lease now, so a standby takes over at
        once instead of after the TTL."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(self.ttl_s + 2)
        if resign and self.lease:
            try:
                self.etcd.revoke(self.lease)
            except KVPoolError as exc:
                log.warning("could not end the lease in etcd (%s): it expires by itself", exc)

    def node_joined(self, node_id: str, data_address: str) -> None:
        """Record a storage node for the next leader (written by the campaign thread)."""
        with self._lock:
            self._pending_nodes.append((node_id, data_address))
        self._wake.set()  # recorded before a failover that may come soon

    # ---------------------------------------------------------------------- the thread
    def _run(self) -> None:
        while not self._stop.is_set() and not self.gone:
            failed = False
            try:
                self._step()
            except KVPoolError as exc:
                failed = True
                log.warning(
                    "etcd: %s (retrying%s)",
                    exc,
                    ", leading until the lease ends" if self.leading else "",
                )
            if self.leading and self.clock() >= self.valid_until:
                self._lose("the lease could not be renewed in time")
            if self.gone:
                return
            self._wake.wait(self._pause(failed))
            self._wake.clear()

    def _pause(self, failed: bool) -> float:
        """A leader renews every margin counted from its last renewal, not from the end
        of a step: slow calls in a step do not push the next renewal later.  A failed
        step waits a little (etcd refusing at once must not spin the thread)."""
        if failed or not self.leading:
            return min(POLL_S, self.margin_s)
        due = self._renewed_at + self.margin_s - self.clock()
        return max(0.0, due) + 0.001  # past the margin, or the step would skip renewing

    def _lose(self, why: str) -> None:
        self.leading, self.gone = False, True
        self.on_lost(why)

    def _step(self) -> None:
        if self.lease == 0:
            sent = self.clock()
            self.lease = self.etcd.grant(self.ttl_s)
            self._renewed_at = sent
            self.etcd.put(
                self.keys.master(self.address), json.dumps({"address": self.address}), self.lease
            )
        # renewed here too when the grant's own step took a margin: a slow etcd must not
        # elect a master on a lease that is about to end
        if self.clock() - self._renewed_at >= self.margin_s:
            sent = self.clock()
            ttl = self.etcd.keepalive(self.lease)
            if ttl <= 0:
                if self.leading:
                    self._lose("etcd says the lease expired")
                    return
                self.lease = 0  # a standby's lease lapsed: a new one next step
                return
            self._renewed_at = sent
            if self.leading:
                self.valid_until = sent + self.ttl_s - self.margin_s
                self.on_renewed(self.valid_until)
        if self.leading:
            self._record_nodes()
            self.on_view(self.address, self.epoch, self._masters())
            return
        # one transaction: the election and what a winner needs, in one round trip
        created, current, revision, (masters_kv, nodes_kv) = self.etcd.create(
            self.keys.leader,
            json.dumps({"address": self.address}),
            self.lease,
            (self.keys.prefix + "masters/", self.keys.prefix + "nodes/"),
        )
        masters = [kv.key.rsplit("/", 1)[-1] for kv in masters_kv]
        if not created and current is not None and current.lease == self.lease:
            # this master's own key on its own lease: an earlier create took effect and
            # its reply was lost.  It leads (else it would hold the key, unled, forever).
            created, revision = True, current.create_revision
        if created:
            self.leading, self.epoch = True, revision
            self.valid_until = self._renewed_at + self.ttl_s - self.margin_s
            nodes = {kv.key.rsplit("/", 1)[-1] for kv in nodes_kv}
            log.info("elected leader, epoch %d (%d node(s) to re-announce)", revision, len(nodes))
            self.on_view(self.address, revision, masters)
            self.on_elected(Elected(revision, self.valid_until, nodes))
            return
        leader, epoch = "", 0
        if current is not None:
            leader = json.loads(current.value).get("address", "")
            epoch = current.create_revision
        self.on_view(leader, epoch, masters)

    def _masters(self) -> list[str]:
        listed = self.etcd.get_prefix(self.keys.prefix + "masters/")
        return [kv.key.rsplit("/", 1)[-1] for kv in listed]

    def _record_nodes(self) -> None:
        with self._lock:
            pending, self._pending_nodes = self._pending_nodes, []
            gone, self._gone_nodes = self._gone_nodes, []
        try:
            while pending:
                node_id, data_address = pending[0]
                self.etcd.put(self.keys.node(node_id), json.dumps({"data_address": data_address}))
                pending.pop(0)
            while gone:
                self.etcd.delete(self.keys.node(gone[0]))
                gone.pop(0)
        finally:  # what etcd did not take is tried again next step
            with self._lock:
                self._pending_nodes[:0] = pending
                self._gone_nodes[:0] = gone

    def forget_nodes(self, node_ids: set[str]) -> None:
        """Nodes a warm-up waited for in vain (gone for good): not waited for again."""
        with self._lock:
            self._gone_nodes.extend(node_ids)
