"""A master's campaign on a real etcd that answers slowly, or whose reply to the winning
create is lost: a leader is still elected, and keeps its lease."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvpool.errors import PeerTimeout
from kvpool.ha.campaign import Campaign, ClusterKeys, Elected, etcd_timeout_s
from kvpool.ha.etcd import Etcd, KeyValue, parse_endpoints
from kvpool.testing.etcd import EtcdCluster
from kvpool.testing.slow_relay import SlowRelay
from tests.waiting import wait_until

TTL_S = 2
KEYS = ClusterKeys("kvpool")


class Seen:
    """What a campaign reported through its callbacks (called on its thread)."""

    def __init__(self) -> None:
        self.elected: list[Elected] = []
        self.renewals: list[float] = []
        self.lost: list[str] = []
        self.views: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def callbacks(self) -> dict[str, Any]:
        return {
            "on_elected": self.elected.append,
            "on_renewed": self.renewals.append,
            "on_view": lambda leader, epoch, _masters: self.views.append((leader, epoch)),
            "on_lost": self.lost.append,
        }


@contextmanager
def campaigning(etcd: Etcd, address: str) -> Iterator[tuple[Campaign, Seen]]:
    seen = Seen()
    campaign = Campaign(etcd, KEYS, address, TTL_S, **seen.callbacks())
    campaign.start()
    try:
        yield campaign, seen
    finally:
        campaign.stop()


def test_an_etcd_that_answers_in_300ms_elects_a_leader_that_keeps_its_lease(
    etcd: EtcdCluster,
) -> None:
    # etcd on a slow disk or a loaded host: every reply 300 ms late, 15% of the lease
    host, port = etcd.endpoints.split(",")[0].rsplit(":", 1)
    with SlowRelay((host, int(port)), 0.3) as relay:
        slow = Etcd(parse_endpoints(relay.endpoint), timeout_s=etcd_timeout_s(TTL_S))
        with campaigning(slow, "10.0.0.1:50051") as (campaign, seen):
            wait_until(lambda: seen.elected, 15, what="elected")
            # three lease lengths later it still leads: renewals kept up
            deadline = time.monotonic() + 3 * TTL_S
            while time.monotonic() < deadline and not seen.lost:
                time.sleep(0.1)
            assert seen.lost == [] and campaign.leading
            assert len(seen.renewals) >= 3
            assert campaign.valid_until > time.monotonic()
            leader = Etcd(parse_endpoints(etcd.endpoints)).get(KEYS.leader)
            assert leader is not None and leader.create_revision == seen.elected[0].epoch


class LosesFirstWinningReply(Etcd):
    """A real etcd whose reply to the first create that wins never arrives (a timeout
    after etcd applied it)."""

    lost_one = False

    def create(
        self, key: str, value: str, lease: int, lists: Any = ()
    ) -> tuple[bool, KeyValue | None, int, list[list[KeyValue]]]:
        reply = super().create(key, value, lease, lists)
        if reply[0] and not self.lost_one:
            self.lost_one = True
            raise PeerTimeout("etcd did not answer (the reply was lost)")
        return reply


def test_a_win_whose_reply_was_lost_is_taken_up_on_the_next_step(etcd: EtcdCluster) -> None:
    client = LosesFirstWinningReply(parse_endpoints(etcd.endpoints))
    with campaigning(client, "10.0.0.1:50051") as (campaign, seen):
        wait_until(lambda: seen.elected, 10, what="elected after the lost reply")
        assert client.lost_one
        key = Etcd(parse_endpoints(etcd.endpoints)).get(KEYS.leader)
        assert key is not None and key.lease == campaign.lease
        assert seen.elected[0].epoch == key.create_revision
