from __future__ import annotations

from kvpool.connectors.transfer.state import RecvResults, SendTracker


def test_request_is_freed_when_every_expected_rank_is_done() -> None:
    t = SendTracker()
    t.hold("r", (1, 2), frozenset({0, 1}), now_ms=0, hold_timeout_ms=100)
    assert t.get("r") is not None
    assert not t.mark_done("r", 0, 10)
    assert t.take_finished() == set()
    assert t.mark_done("r", 1, 10)
    assert t.take_finished() == {"r"}
    assert t.take_finished() == set()
    assert t.get("r") is None and t.was_released("r")
    assert not t.mark_done("r", 1)  # a late duplicate changes nothing


def test_expiry_frees_at_the_deadline_not_before() -> None:
    t = SendTracker()
    t.hold("r", (1,), frozenset({0}), now_ms=1000, hold_timeout_ms=50)
    assert t.expire(1049) == []
    assert t.expire(1050) == ["r"]
    assert t.take_finished() == {"r"}
    assert t.num_expired == 1 and len(t) == 0


def test_nobody_reads_from_this_rank_frees_at_once() -> None:
    t = SendTracker()
    t.hold("r", (1,), frozenset(), now_ms=0, hold_timeout_ms=50)
    assert len(t) == 0 and t.take_finished() == {"r"}


def test_released_ids_are_remembered_but_bounded() -> None:
    t = SendTracker()
    for i in range(SendTracker.REMEMBER_RELEASED + 10):
        t.hold(f"r{i}", (1,), frozenset(), now_ms=0, hold_timeout_ms=1)
    t.take_finished()
    assert not t.was_released("r0")
    assert t.was_released(f"r{SendTracker.REMEMBER_RELEASED + 9}")


def test_failed_loads_are_finished_too_and_reported_once() -> None:
    r = RecvResults()
    r.succeeded("ok", 100)
    r.failed("bad", [3, 4])
    snap = r.take()
    assert snap.finished == {"ok", "bad"}
    assert snap.failed == {"bad"}
    assert snap.failed_block_ids == {3, 4}
    empty = r.take()
    assert not (empty.finished or empty.failed or empty.failed_block_ids)
    assert (r.num_ok, r.num_failed, r.bytes_received) == (1, 1, 100)
