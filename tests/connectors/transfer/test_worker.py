from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest

from kvpool.config.kv_transfer import TransferConfig
from kvpool.config.topology import Topology
from kvpool.connectors.transfer.jobs import HoldJob, ReleaseJob, TransferJobs
from kvpool.connectors.transfer.worker import RankInfo, TransferWorker
from tests.connectors.transfer.helpers import (
    BLOCK,
    LAYERS,
    NUM_BLOCKS,
    POLL_S,
    ROW,
    Clock,
    caches,
    config,
    free_port,
    recv_job,
    start,
    wait_results,
)
from tests.threads import run_threads
from tests.waiting import wait_until


def test_decode_pulls_whole_blocks_into_its_own_block_ids(workers: list[TransferWorker]) -> None:
    port = free_port()
    p, p_kv = start(workers, config("kv_producer", port), 0, 1, 2, seed=1)
    d, d_kv = start(workers, config("kv_consumer", port + 100), 0, 1, 2, seed=None)
    p.submit(TransferJobs(holds=[HoldJob("p-r1", (5, 2, 7))]))
    assert p.num_held == 1
    d.submit(TransferJobs(recvs=[recv_job("r1", [0, 1], [5, 2], port)]))
    res = wait_results(d, want_recv="r1")
    assert res.failed_recving == set()
    assert d.take_load_errors() == set()
    for name in LAYERS:
        np.testing.assert_array_equal(d_kv[name][[0, 1]], p_kv[name][[5, 2]])
        assert not d_kv[name][2:].any()  # nothing else written
    # P frees the blocks once its only decode rank has them
    assert "p-r1" in wait_results(p, want_send="p-r1").finished_sending
    assert p.num_held == 0
    page = 2 * BLOCK * ROW
    assert d.take_counts() == {"pulls": 1, "pulled_blocks": 2, "pulled_bytes": 2 * 2 * page}
    counts = p.take_counts()
    assert counts["holds"] == counts["served_pulls"] == counts["holds_released"] == 1
    assert counts["served_bytes"] == 2 * 2 * page and "holds_expired" not in counts
    assert not any(p.take_counts().values())  # deltas: taken once


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2), (4, 2), (2, 4)])
def test_heterogeneous_tp_reassembles_every_head(
    workers: list[TransferWorker], p_tp: int, d_tp: int
) -> None:
    heads = 4
    port = free_port(p_tp)
    prefill = [
        start(workers, config("kv_producer", port, peer_tp=d_tp), r, p_tp, heads, seed=10 + r)
        for r in range(p_tp)
    ]
    decode = [
        start(workers, config("kv_consumer", port + 100, peer_tp=p_tp), r, d_tp, heads, seed=None)
        for r in range(d_tp)
    ]
    for p, _ in prefill:
        p.submit(TransferJobs(holds=[HoldJob("p-x", (3, 4))]))
    for d, _ in decode:
        d.submit(TransferJobs(recvs=[recv_job("x", [6, 1], [3, 4], port, tp=p_tp)]))
    for d, _ in decode:
        assert wait_results(d, want_recv="x").failed_recving == set()
    for name in LAYERS:
        # the full head axis, as one model would hold it, on both sides
        full_p = np.concatenate([kv[name][[3, 4]] for _, kv in prefill], axis=1)
        full_d = np.concatenate([kv[name][[6, 1]] for _, kv in decode], axis=1)
        np.testing.assert_array_equal(full_d, full_p)
    for p, _ in prefill:
        assert "p-x" in wait_results(p, want_send="p-x").finished_sending


def test_pull_before_the_hold_arrives_waits_for_it(workers: list[TransferWorker]) -> None:
    port = free_port()
    p, p_kv = start(workers, config("kv_producer", port), 0, 1, 2, seed=3)
    d, d_kv = start(workers, config("kv_consumer", port + 100), 0, 1, 2, seed=None)
    d.submit(TransferJobs(recvs=[recv_job("late", [4], [1], port)]))
    wait_until(lambda: p.num_waiting_pulls == 1, POLL_S, what="the pull waiting on P's hold")
    p.submit(TransferJobs(holds=[HoldJob("p-late", (1,))]))
    assert wait_results(d, want_recv="late").failed_recving == set()
    for name in LAYERS:  # nothing lost while it waited: every layer arrived whole
        np.testing.assert_array_equal(d_kv[name][4], p_kv[name][1])
    assert p.num_waiting_pulls == 0
    assert d.take_counts() == {"pulls": 1, "pulled_blocks": 1, "pulled_bytes": 2 * 2 * BLOCK * ROW}
    assert "p-late" in wait_results(p, want_send="p-late").finished_sending
    assert p.take_counts()["served_pulls"] == 1


# An engine step that runs no forward may wait for a transfer to end (idle_wait_ms), so
# that the step itself reports it.  The waits below are long upper bounds: each call must
# come back with the result (or at once, when nothing is in flight), never by the bound.
LONG_WAIT_S = 60.0


def test_an_idle_step_reports_the_load_that_ends_while_it_waits(
    workers: list[TransferWorker],
) -> None:
    port = free_port()
    p, p_kv = start(workers, config("kv_producer", port), 0, 1, 2, seed=5)
    d, d_kv = start(workers, config("kv_consumer", port + 100), 0, 1, 2, seed=None)
    p.submit(TransferJobs(holds=[HoldJob("p-w1", (3,))]))
    d.submit(TransferJobs(recvs=[recv_job("w1", [6], [3], port)]))
    # one call each: D's returns with its finished load, P's with the release of its hold
    assert d.results(LONG_WAIT_S).finished_recving == {"w1"}
    assert p.results(LONG_WAIT_S).finished_sending == {"p-w1"}
    for name in LAYERS:
        np.testing.assert_array_equal(d_kv[name][6], p_kv[name][3])


def test_an_idle_step_with_nothing_in_flight_does_not_wait(workers: list[TransferWorker]) -> None:
    port = free_port()
    p, _ = start(workers, config("kv_producer", port), 0, 1, 2, seed=6)
    d, _ = start(workers, config("kv_consumer", port + 100), 0, 1, 2, seed=None)
    done: list[object] = []
    callers = [threading.Thread(target=lambda w=w: done.append(w.results(3600.0))) for w in (p, d)]
    run_threads(callers, LONG_WAIT_S)
    assert len(done) == 2, "results() waited although nothing was in flight"


def test_dead_prefill_is_a_failed_and_finished_load(workers: list[TransferWorker]) -> None:
    port = free_port()  # nothing listens there
    d, _ = start(workers, config("kv_consumer", port + 100), 0, 1, 2, seed=None)
    started = time.monotonic()
    d.submit(TransferJobs(recvs=[recv_job("dead", [2, 3], [0, 1], port)]))
    res = wait_results(d, want_recv="dead")
    assert res.failed_recving == {"dead"}
    assert d.take_counts() == {"pull_failures": 1}
    assert d.take_load_errors() == {2, 3}
    assert d.take_load_errors() == set()  # reported once
    assert time.monotonic() - started < POLL_S


def test_silent_prefill_times_out_instead_of_hanging(workers: list[TransferWorker]) -> None:
    port = free_port()
    silent = socket.create_server(("127.0.0.1", port))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        silent.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(silent.accept()[0])  # accept, read nothing, answer nothing
            except TimeoutError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        d, _ = start(workers, config("kv_consumer", port + 100, transfer=300), 0, 1, 2, seed=None)
        d.submit(TransferJobs(recvs=[recv_job("hung", [1], [1], port)]))
        assert wait_results(d, want_recv="hung").failed_recving == {"hung"}
        assert d.take_load_errors() == {1}
    finally:
        stop.set()
        t.join(2)
        silent.close()
        for s in accepted:
            s.close()


def test_prefill_frees_blocks_of_a_decode_that_never_comes(workers: list[TransferWorker]) -> None:
    clock = Clock()
    port = free_port()
    p, _ = start(
        workers, config("kv_producer", port, hold=5000, transfer=500), 0, 1, 2, seed=1, clock=clock
    )
    p.submit(TransferJobs(holds=[HoldJob("p-gone", (1, 2))]))
    assert p.results().finished_sending == set()
    clock.now += 4.9
    assert p.results().finished_sending == set()
    clock.now += 0.2
    assert p.results().finished_sending == {"p-gone"}
    assert p.num_held == 0
    assert p.take_counts()["holds_expired"] == 1
    assert p.results().finished_sending == set()  # reported once
    # a decode arriving after that is refused (the blocks belong to someone else now)
    d, _ = start(workers, config("kv_consumer", port + 100), 0, 1, 2, seed=None)
    d.submit(TransferJobs(recvs=[recv_job("gone", [0, 1], [1, 2], port)]))
    assert wait_results(d, want_recv="gone").failed_recving == {"gone"}


def test_release_frees_without_a_transfer(workers: list[TransferWorker]) -> None:
    port = free_port()
    p, _ = start(workers, config("kv_producer", port), 0, 1, 2, seed=1)
    d, _ = start(workers, config("kv_consumer", port + 100), 0, 1, 2, seed=None)
    p.submit(TransferJobs(holds=[HoldJob("p-rel", (0,))]))
    d.submit(TransferJobs(releases=[ReleaseJob("rel", "p-rel", "127.0.0.1", port, 1)]))
    assert "p-rel" in wait_results(p, want_send="p-rel").finished_sending
    assert d.results().finished_recving == set()  # a release is not a load


@pytest.mark.parametrize("case", ["blocks", "tp", "group"])
def test_prefill_refuses_bad_pulls(
    workers: list[TransferWorker], case: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("WARNING", logger="vllm.kvpool.transfer")
    port = free_port()
    p, _ = start(workers, config("kv_producer", port), 0, 1, 2, seed=1)
    d_cfg = config("kv_consumer", port + 100)
    d_tp = 1
    if case == "group":
        d_cfg = TransferConfig("kv_consumer", port + 100, "group-b", Topology(1, 1))
    if case == "tp":
        d_tp = 2  # P's config says the decode runs tp 1
    d, _ = start(workers, d_cfg, 0, d_tp, 2, seed=None)
    p.submit(TransferJobs(holds=[HoldJob("p-bad", (1, 2))]))
    remote = [1, 3] if case == "blocks" else [1, 2]
    d.submit(TransferJobs(recvs=[recv_job("bad", [0, 1], remote, port)]))
    assert wait_results(d, want_recv="bad").failed_recving == {"bad"}
    if case == "blocks":
        # a decode of the right group and layout gave up: P stops holding at once
        assert "p-bad" in wait_results(p, want_send="p-bad").finished_sending
    else:
        assert p.num_held == 1  # a foreign decode cannot release it either
    if case == "tp":
        # the guide's §5.4 trap on P: the refusal names the key to fix
        assert 'this prefill\'s kv_connector_extra_config["decode"] says 1' in caplog.text


def test_caches_must_match_the_rank_layout(workers: list[TransferWorker]) -> None:
    from kvpool.errors import ConfigError

    worker = TransferWorker(config("kv_consumer", free_port()), RankInfo(0, 2, 0, 8))
    workers.append(worker)
    with pytest.raises(ConfigError, match="should hold 4"):
        worker.register(caches(2, None)[0])


def _threads(prefix: str) -> int:
    return sum(t.name.startswith(prefix) and t.is_alive() for t in threading.enumerate())


def test_nothing_leaks_after_many_pulls_and_failures(workers: list[TransferWorker]) -> None:
    """Held blocks, server threads and sockets all return to zero after pulls and failures."""
    port = free_port()
    p, _ = start(workers, config("kv_producer", port), 0, 1, 2, seed=1)
    d, _ = start(workers, config("kv_consumer", port + 100), 0, 1, 2, seed=None)
    fds_before = len(os.listdir("/proc/self/fd"))
    for i in range(20):
        p.submit(TransferJobs(holds=[HoldJob(f"p-{i}", (i % NUM_BLOCKS,))]))
        remote = [i % NUM_BLOCKS] if i % 4 else [(i + 1) % NUM_BLOCKS]  # every 4th is refused
        d.submit(TransferJobs(recvs=[recv_job(str(i), [0], remote, port)]))
        wait_results(d, want_recv=str(i))
    # refused pulls released their holds too (the decode recomputes them)
    wait_results(p, want_send="p-16")
    wait_until(lambda: p.results() is not None and p.num_held == 0, POLL_S, what="no holds")
    # each decode connection's thread ends when the decode closes it
    wait_until(lambda: _threads("kvpool-kv-send") == 0, POLL_S, what="no send threads")
    assert len(os.listdir("/proc/self/fd")) == fds_before  # every socket closed, both sides
