"""What the master waits on nodes for, in-process and on a test clock: the replies it holds
(a put behind a node's copy, a put until its node has the catalog entry, a node's long
poll), and how each is answered -- when the node reports, or at its deadline."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

from kvpool.core.objects import Demote, IndexConfig, State
from kvpool.master.copies import Later
from kvpool.master.node_links import QUEUE_DEPTH, NodeLinks
from kvpool.master.service import MasterService
from kvpool.protocol import messages as m
from kvpool.protocol.data import Error, Ok
from kvpool.tenancy.master import tenant_request
from tests.waiting import wait_until

NODE = "node-h-1"


class Clock:
    def __init__(self) -> None:
        self.now = 1000

    def __call__(self) -> int:
        return self.now


class FakeLinks:
    """Records the copies the master asks for; the test reports them."""

    def __init__(self) -> None:
        self.asked: list[tuple[Demote, Callable[[Demote, bool], None]]] = []

    def demote(self, address: str, event: Demote, done: Callable[[Demote, bool], None]) -> None:
        self.asked.append((event, done))


def service(memory: int = 30) -> tuple[MasterService, Clock, FakeLinks]:
    clock = Clock()
    svc = MasterService(IndexConfig(enable_offload=True, policy="lru"), clock=clock)
    links = FakeLinks()
    svc.node_copies.copies.links = links  # type: ignore[assignment]
    svc.handle(m.Register(NODE, "127.0.0.1:1", "t"))
    svc.handle(m.AddSegment(NODE, f"{NODE}/mem", memory, "memory", "shm"))
    svc.handle(m.AddSegment(NODE, f"{NODE}/ssd", 1000, "ssd"))
    return svc, clock, links


def held(svc: MasterService, request: m.MasterRequest) -> tuple[Later, list[m.MasterReply]]:
    """Submit a request whose reply must wait; the list gets the reply when sent."""
    later = svc.submit(request)
    assert isinstance(later, Later), later
    sent: list[m.MasterReply] = []
    later.deliver = sent.append
    return later, sent


def fill(svc: MasterService) -> None:
    """Three objects fill the node's memory (the master is their catalog's source)."""
    for key in ("a", "b", "c"):
        assert svc.handle(m.PutStart("w", key, 10)).placed  # type: ignore[union-attr]
        assert svc.handle(m.PutEnd("w", key, 7)) == Ok()


def test_a_put_behind_a_copy_waits_and_gets_the_room_when_the_node_reports() -> None:
    svc, _, links = service()
    fill(svc)
    _, sent = held(svc, m.PutStart("w", "d", 10))
    (event, done), *_ = links.asked
    assert event.key == "a" and event.in_flight
    # being copied, it is still read from memory (a probe never misses it)
    assert svc.index.state_of("a") is State.DEMOTING and svc.index.exists("a")
    svc.settle()
    assert sent == []  # nothing reported: still waiting
    assert svc.handle(m.Exists("b")) == m.Bools([True])  # everyone else is served
    done(event, True)  # the node's link thread reports
    svc.settle()
    (reply,) = sent
    assert isinstance(reply, m.Placement) and reply.placed and reply.offset == event.src.offset
    assert svc.index.location_of("a") == event.dst  # readable from SSD now
    svc.index.check()


def test_a_put_behind_a_copy_the_node_never_reports_gets_the_room_at_its_deadline() -> None:
    svc, clock, links = service()
    fill(svc)
    _, sent = held(svc, m.PutStart("w", "d", 10))
    clock.now += svc.node_copies.room_wait_ms
    svc.settle()
    (reply,) = sent
    assert isinstance(reply, m.Placement) and reply.placed
    assert svc.index.state_of("a") is None  # given up: dropped, never half-present
    assert svc.index.stats.demote_failures == 1
    # the silent node's next victims are dropped, not copied: the next put is answered now
    assert svc.handle(m.PutEnd("w", "d", 7)) == Ok()
    reply = svc.submit(m.PutStart("w", "e", 10))
    assert isinstance(reply, m.Placement) and reply.placed and len(links.asked) == 1
    # a late report of the abandoned copy changes nothing, and the node is copied to again
    event, done = links.asked[0]
    done(event, True)
    svc.settle()
    assert svc.index.state_of("a") is None
    assert svc.handle(m.PutEnd("w", "e", 7)) == Ok()
    held(svc, m.PutStart("w", "f", 10))
    assert [e.key for e, _ in links.asked] == ["a", "c"]
    svc.index.check()


def test_without_a_server_to_hold_it_a_put_behind_a_copy_is_no_space_at_once() -> None:
    svc, _, _ = service()
    fill(svc)
    reply = svc.handle(m.PutStart("w", "d", 10))
    assert isinstance(reply, Error) and reply.code == "NO_SPACE" and "being copied" in reply.message


def test_a_held_batch_is_answered_whole_when_the_room_comes() -> None:
    svc, _, links = service()
    fill(svc)
    _, sent = held(svc, m.BatchPutStart("w", ["d", "e"], [10, 10]))
    for event, done in links.asked:
        done(event, True)
    svc.settle()
    if not sent:  # the second key needed a second copy
        for event, done in links.asked[1:]:
            done(event, True)
        svc.settle()
    (reply,) = sent
    assert isinstance(reply, m.Placements) and [p.placed for p in reply.items] == [True, True]


def test_a_put_into_a_node_is_answered_once_the_node_confirmed_its_catalog_entry() -> None:
    svc, _, _ = service(memory=100)
    svc.outbox.take(NODE)  # the node is up to date
    _, poll = held(svc, m.Heartbeat(NODE))  # its long poll: nothing to say yet
    assert svc.handle(m.PutStart("w", "k", 10)).placed  # type: ignore[union-attr]
    _, acked = held(svc, m.PutEnd("w", "k", 7))
    assert svc.index.exists("k")  # visible at once; only the answer waits
    svc.settle()
    (changes,) = poll  # the poll is answered with the new entry ...
    assert isinstance(changes, m.HeartbeatReply) and [e[0] for e in changes.added] == ["k"]
    assert acked == []  # ... but the node has not applied it yet
    _, poll = held(svc, m.Heartbeat(NODE))  # its next heartbeat confirms it
    svc.settle()
    assert acked == [Ok()] and poll == []


def test_a_noted_put_is_answered_at_once_and_its_entry_still_reaches_the_node() -> None:
    """The node noted the entry from the tagged write: no confirmation to wait for; the
    catalog add is still sent (it moves the node's note into its catalog)."""
    svc, _, _ = service(memory=100)
    svc.outbox.take(NODE)
    _, poll = held(svc, m.Heartbeat(NODE))
    assert svc.handle(m.PutStart("w", "k", 10)).placed  # type: ignore[union-attr]
    assert svc.submit(m.PutEnd("w", "k", 7, noted=True)) == Ok()  # no heartbeat came back
    svc.settle()
    (changes,) = poll
    assert isinstance(changes, m.HeartbeatReply) and [e[0] for e in changes.added] == ["k"]
    reply = svc.handle(m.BatchPutStart("w", ["a", "b"], [10, 10]))
    assert isinstance(reply, m.Placements) and all(p.placed for p in reply.items)
    assert svc.submit(m.BatchPutEnd("w", ["a", "b"], [1, 2], noted=True)) == m.Bools([True, True])


def test_a_tenants_put_end_is_never_noted() -> None:
    """A node ignores a tenant's write tags, so a tenant's ``noted`` cannot skip the
    wait for the node's catalog entry."""
    scoped = tenant_request("red", m.PutEnd("red", "k", 7, noted=True))
    assert isinstance(scoped, m.PutEnd) and scoped.key == "@red/k" and not scoped.noted
    batch = tenant_request("red", m.BatchPutEnd("red", ["a", "b"], [1, 2], noted=True))
    assert isinstance(batch, m.BatchPutEnd) and batch.keys == ["@red/a", "@red/b"]
    assert not batch.noted


def test_a_put_its_node_never_confirms_is_a_timeout_at_the_deadline() -> None:
    svc, clock, _ = service(memory=100)
    assert svc.handle(m.PutStart("w", "k", 10)).placed  # type: ignore[union-attr]
    _, acked = held(svc, m.PutEnd("w", "k", 7))
    clock.now += svc.node_copies.catalog_wait_ms
    svc.settle()
    (reply,) = acked
    assert isinstance(reply, Error) and reply.code == "TIMEOUT"


def test_a_long_poll_with_nothing_to_say_is_answered_empty_after_the_interval() -> None:
    svc, clock, _ = service()
    svc.outbox.take(NODE)
    _, poll = held(svc, m.Heartbeat(NODE))
    svc.settle()
    assert poll == []
    clock.now += svc.heartbeat_interval_ms
    svc.settle()
    assert poll == [m.HeartbeatReply([], [])]


def test_a_nodes_link_answers_every_copy_even_a_dead_nodes_and_bounds_its_queue() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    svc, _, _ = service()
    fill(svc)
    event = Demote("a", svc.index.location_of("a"), svc.index.location_of("b"), 7, True)  # type: ignore[arg-type]
    outcomes: list[bool] = []
    gate = threading.Event()
    with NodeLinks(timeout_s=1.0) as links:
        links.demote(address, event, lambda e, ok: outcomes.append(ok))
        wait_until(lambda: outcomes == [False], what="a dead node's copy failed")
        # a node whose link is busy: what does not fit in its queue fails at once
        links._worker(address).submit(lambda conn: gate.wait(10) and None)  # type: ignore[func-returns-value]
        for _ in range(QUEUE_DEPTH + 1):
            links.demote(address, event, lambda e, ok: outcomes.append(ok))
        assert outcomes.count(False) >= 2  # the first, and the one that found it full
        gate.set()
        wait_until(lambda: len(outcomes) == QUEUE_DEPTH + 2, what="every copy answered")
    assert not any(outcomes)
