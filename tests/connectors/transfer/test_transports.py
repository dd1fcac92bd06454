"""Both P→D transports keep the same promises: kvpool's TCP and Mooncake's Transfer Engine.

Each scenario (``scenarios.py``) runs real workers on one transport and returns what
happened; the assertions here are the same for both.  kvpool's TCP runs in this process
on 127.0.0.1; the Transfer Engine (with its own ``tcp`` protocol: the node config's
``"transport": "transfer_engine"`` switch) binds every interface, so its scenarios run
in a private network namespace (:class:`~kvpool.testing.mooncake.Namespace`), and a
missing Mooncake wheel fails them.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.testing.mooncake import Namespace
from tests.connectors.transfer import scenarios
from tests.connectors.transfer.helpers import BLOCK, LAYERS, POLL_S, ROW, Run, on_transport


@pytest.fixture(params=["kvpool", scenarios.ENGINE])
def run(request: pytest.FixtureRequest) -> Run:
    """``run("scenario", *args)`` on this test's transport."""
    return on_transport(request, scenarios)


NAMES = {"kvpool": "tcp", scenarios.ENGINE: "tcp (Mooncake Transfer Engine)"}


def test_pages_arrive_byte_equal_and_the_hold_is_freed(
    run: Run, request: pytest.FixtureRequest
) -> None:
    got = run("pull_pages")
    assert got["name"] == NAMES[request.node.callspec.params["run"]]  # the transport chosen
    assert got["failed"] == set() and got["load_errors"] == set()
    for name in LAYERS:
        np.testing.assert_array_equal(got["got"][name][[0, 1]], got["sent"][name])
        assert not got["got"][name][2:].any()  # nothing else written
    assert "p-r1" in got["finished_sending"] and got["held"] == 0
    nbytes = 2 * 2 * 2 * BLOCK * ROW  # 2 blocks x 2 layers x 2 heads
    assert got["d_counts"] == {"pulls": 1, "pulled_blocks": 2, "pulled_bytes": nbytes}
    assert got["p_counts"]["served_pulls"] == 1 and got["p_counts"]["served_bytes"] == nbytes


def test_blocks_back_to_back_arrive_whole(run: Run) -> None:
    got = run("adjacent_blocks")
    assert got["failed"] == set() and got["untouched"]
    for name in LAYERS:
        np.testing.assert_array_equal(got["got"][name], got["sent"][name])


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2), (4, 2), (2, 4)])
def test_heterogeneous_tp_lands_every_head_in_place(run: Run, p_tp: int, d_tp: int) -> None:
    got = run("heterogeneous", p_tp, d_tp)
    assert got["failed"] == set()
    for name in LAYERS:
        np.testing.assert_array_equal(got["full_d"][name], got["full_p"][name])
    assert got["untouched"]  # only the pulled blocks were written
    assert got["finished_sending"] == {"p-x"}


def test_a_refusal_is_a_transfer_error_with_the_prefills_reason(run: Run) -> None:
    assert run("refusal") == "TransferError: prefill refused: blocks [3] are not this request's"


def test_a_dead_prefill_is_a_failed_load_at_once(run: Run) -> None:
    got = run("dead_prefill")
    assert got["failed"] == {"dead"} and got["load_errors"] == {2, 3}
    assert got["counts"] == {"pull_failures": 1}
    assert got["connect_error"] == "PeerUnreachable"
    assert got["elapsed"] < POLL_S


def test_a_silent_prefill_times_out_instead_of_hanging(run: Run) -> None:
    got = run("silent_prefill")
    assert got["failed"] == {"hung"} and got["load_errors"] == {1}
    assert got["elapsed"] < POLL_S


def test_a_pull_done_frees_the_hold_without_a_load(run: Run) -> None:
    got = run("pull_done")
    assert got["finished_sending"] == {"p-rel"} and got["held"] == 0
    assert got["recving"] == set()


def test_a_prefill_whose_engine_is_gone_fails_the_load_and_is_told(namespace: Namespace) -> None:
    got = namespace.run("tests.connectors.transfer.scenarios:engine_gone", scenarios.ENGINE)
    assert got["failed"] == {"gone"} and got["load_errors"] == {1}
    assert got["heard"] == ["Pull", "Unread", "PullDone"]  # P learns why, then frees the hold
    assert got["untouched"] and got["elapsed"] < POLL_S
