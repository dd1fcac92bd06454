"""The leadership gate's rules, without a process: time is a parameter."""

from __future__ import annotations

from kvpool.ha.leadership import Leadership
from kvpool.protocol import messages as m
from kvpool.protocol.data import Error

PUT = m.PutStart("c", "k", 10)


def refused(reply: object) -> bool:
    return isinstance(reply, Error) and reply.code == "NOT_LEADER"


def test_a_single_master_always_serves_and_says_it_leads() -> None:
    gate = Leadership("10.0.0.1:50088")
    assert gate.answer(PUT, 0.0) is None
    assert gate.answer(m.WhoLeads(), 0.0) == m.LeaderInfo(
        "single", 0, "10.0.0.1:50088", "10.0.0.1:50088"
    )


def test_a_standby_refuses_all_but_who_leads_and_names_the_leader() -> None:
    gate = Leadership("b:1", ha=True)
    reply = gate.answer(PUT, 0.0)
    assert refused(reply) and "no master leads now" in reply.message  # type: ignore[union-attr]
    gate.follow("a:1", 7, ["a:1", "b:1"])
    reply = gate.answer(PUT, 0.0)
    assert refused(reply) and "the leader is a:1" in reply.message  # type: ignore[union-attr]
    who = gate.answer(m.WhoLeads(), 0.0)
    assert who == m.LeaderInfo("standby", 7, "a:1", "b:1", standbys=["b:1"])


def test_a_leader_serves_only_until_its_lease_and_never_after_losing_it() -> None:
    gate = Leadership("a:1", ha=True)
    gate.elected(9, valid_until=10.0, nodes=set(), now=0.0, warmup_s=5.0)
    assert gate.answer(PUT, 9.9) is None
    assert refused(gate.answer(PUT, 10.0))  # a renewal that did not come in time
    gate.renewed(20.0)
    assert gate.answer(PUT, 15.0) is None
    gate.lost()
    gate.renewed(30.0)  # a late renewal cannot bring it back
    assert refused(gate.answer(PUT, 16.0))
    assert gate.who(16.0).role == "gone"


def test_a_new_leader_serves_its_nodes_first_and_clients_once_they_re_announced() -> None:
    gate = Leadership("a:1", ha=True)
    gate.elected(9, valid_until=100.0, nodes={"n1", "n2"}, now=0.0, warmup_s=5.0)
    register = m.Register("n1", "10.0.0.9:7000")
    assert gate.answer(register, 1.0) is None
    assert gate.served(register, m.RegisterReply(True, 1000, 100)) == "n1"
    assert refused(gate.answer(PUT, 1.0))
    done = m.Restore("n1", "n1/mem", [], done=True)
    gate.served(done, m.Bools([]))
    assert gate.who(1.0).warming == 1
    gate.served(m.Heartbeat("n2"), m.HeartbeatReply([], []))
    assert gate.answer(PUT, 1.0) is None and gate.who(1.0).warming == 0


def test_a_warm_up_ends_at_its_bound_when_a_node_never_comes() -> None:
    gate = Leadership("a:1", ha=True)
    gate.elected(9, valid_until=100.0, nodes={"dead"}, now=0.0, warmup_s=5.0)
    assert refused(gate.answer(PUT, 4.9))
    assert gate.answer(PUT, 5.0) is None
