"""Saves off the step: the worker hands pages to its save queue and the step returns."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch

from kvpool.connectors.store.groups import HeadGroups
from kvpool.connectors.store.plan import SaveSpec, StorePlan
from kvpool.connectors.store.pool import PoolHandle
from kvpool.connectors.store.worker import StoreWorker
from kvpool.errors import KVPoolError
from tests.connectors.store.fake_pool import FakePool
from tests.connectors.store.test_worker import (
    keys,
    kv_caches,
    load_back,
    load_plan,
    make,
    save_plan,
)
from tests.waiting import wait_until

PAGE = 3 * 2 * 4 * 6 * 4  # layers x heads x block_size x row x float32, as kv_caches makes


class GatedPool(FakePool):
    """A pool whose puts wait until the test opens the gate: a slow pool, for real (the
    writer thread blocks in the put as it would on a busy node)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()

    def batch_put_parts(
        self,
        keys: Sequence[str],
        parts: Sequence[Sequence[Any]],
        *,
        parents: Sequence[str | None] | None = None,
    ) -> list[KVPoolError | None]:
        self.entered.set()
        self.gate.wait()
        return super().batch_put_parts(keys, parts, parents=parents)


def async_worker(
    pool: FakePool,
    caches: dict[str, torch.Tensor],
    pages: int = 16,
    rank: int = 0,
    groups: HeadGroups | None = None,
) -> StoreWorker:
    def handle() -> PoolHandle:  # reconnects at once after an outage
        return PoolHandle(lambda: pool, reconnect_interval_s=0, describe="fake")

    worker = StoreWorker(
        tp_rank=rank,
        pool=handle(),
        loader_pool=handle(),
        saver_pool=handle(),
        logger=logging.getLogger("t"),
        groups=groups,
        save_buffer_bytes=pages * PAGE,
        drain_s=10,
    )
    worker.register(caches)
    return worker


def test_the_step_returns_before_the_put_and_reused_blocks_do_not_change_what_is_saved() -> None:
    """Why no block is held: the save owns a copy, so vLLM overwriting the blocks right
    after the step (another request reusing them) changes nothing the pool receives."""
    pool = GatedPool()
    src = kv_caches(1)
    original = {n: t.clone() for n, t in src.items()}
    worker = async_worker(pool, src)
    worker.save(save_plan((3, 0, 7), keys(3)))  # returns with the put still waiting
    assert pool.entered.wait(10) and pool.objects == {}
    for t in src.values():  # the blocks are reused at once by another request
        t[[3, 0, 7]] = -1.0
    pool.gate.set()
    assert worker.wait_saved(10)
    assert worker.counters["saved_blocks"] == 3 and worker.counters["save_waits"] == 0
    load_back(pool, original)
    worker.shutdown()


def test_a_full_staging_waits_for_the_writer_and_drops_nothing() -> None:
    pool = GatedPool()
    worker = async_worker(pool, kv_caches(1), pages=2)
    worker.save(save_plan((0, 1), keys(2)))  # both pages staged, the put waits
    assert pool.entered.wait(10)
    step = threading.Thread(target=worker.save, args=(save_plan((2,), keys(1, "z")),))
    step.start()  # a step that finds the staging full
    wait_until(lambda: worker.counters["save_waits"] == 1, timeout_s=10, what="the step to wait")
    assert step.is_alive()
    pool.gate.set()
    step.join(10)
    assert worker.wait_saved(10)
    assert set(pool.objects) == {*keys(2), *keys(1, "z")}
    assert worker.counters["saved_blocks"] == 3 and worker.counters["skipped_blocks"] == 0
    worker.shutdown()


def test_a_save_larger_than_the_staging_goes_through_in_smaller_batches() -> None:
    pool = FakePool()
    worker = async_worker(pool, kv_caches(1), pages=3)
    worker.save(save_plan(tuple(range(10)), keys(10)))
    assert worker.wait_saved(10)
    assert set(pool.objects) == set(keys(10))
    assert list(pool.parents.values()) == [None, *keys(10)[:-1]]  # the chain is kept
    worker.shutdown()


def test_a_failed_put_is_counted_skips_its_chain_and_reads_back_as_a_miss() -> None:
    pool = FakePool()
    src = kv_caches(1)
    worker = async_worker(pool, src, pages=2)
    pool.down = True
    worker.save(save_plan((0, 1, 2, 3, 4), keys(5)))  # three batches of at most 2 pages
    assert worker.wait_saved(10)
    counts = worker.take_counters()
    assert counts["save_errors"] == 1 and counts["saved_blocks"] == 0
    assert counts["skipped_blocks"] == 3  # the later batches hang off the failed chunk
    assert worker.take_counters()["save_errors"] == 0  # reported once
    pool.down = False
    loader = make(pool, kv_caches(2))
    loader.start_loads(load_plan((6, 7), keys(2)))
    assert loader.take_invalid_block_ids() == {6, 7}  # a miss, recomputed: no wrong bytes
    worker.save(save_plan((5,), keys(1, "n")))  # the next save goes through
    assert worker.wait_saved(10) and keys(1, "n")[0] in pool.objects
    worker.shutdown()


def test_a_rank_saves_its_own_head_group_through_the_staging() -> None:
    pool = FakePool()
    src = kv_caches(1)
    worker = async_worker(pool, src, rank=1, groups=HeadGroups(4, 2, 2))
    worker.save(StorePlan(saves=(SaveSpec("r", (4,), (keys(1, "a"), keys(1, "b")), (None,) * 2),)))
    assert worker.wait_saved(10)
    assert list(pool.objects) == [keys(1, "b")[0]]
    # this rank holds heads 2 and 3 as its 2 heads; one group is its whole page
    expected = b"".join(bytes(t[4].contiguous().view(torch.uint8).numpy()) for t in src.values())
    assert pool.objects[keys(1, "b")[0]] == expected
    worker.shutdown()


def test_shutdown_is_bounded_and_counts_what_it_did_not_save() -> None:
    pool = GatedPool()  # the gate never opens: a pool that hangs
    worker = async_worker(pool, kv_caches(1), pages=4)
    worker._drain_s = 0.2
    worker.save(save_plan((0, 1), keys(2)))
    assert pool.entered.wait(10)
    worker.save(save_plan((2,), keys(1, "q")))  # queued behind the hung put
    worker.shutdown()
    assert worker.counters["skipped_blocks"] == 1 and pool.objects == {}
    pool.gate.set()  # the hung put ends; nothing is saved after shutdown


def test_a_step_that_may_end_an_answer_returns_once_its_saves_are_in_the_pool() -> None:
    """Read-your-writes: a step whose plan names a request in ``commit`` returns only once
    that request's saves are put, so its answer never reaches a client before its prefix
    reaches the pool; another request's saves are not waited for."""
    pool = GatedPool()
    worker = async_worker(pool, kv_caches(1))
    spec = SaveSpec("r", (3, 0), (keys(2),), (None,))
    step = threading.Thread(target=worker.save, args=(StorePlan(saves=(spec,), commit=("r",)),))
    step.start()
    assert pool.entered.wait(10)
    step.join(0.3)
    assert step.is_alive() and pool.objects == {}  # the step waits on the put
    other = threading.Thread(target=worker.save, args=(StorePlan(commit=("someone else",)),))
    other.start()
    other.join(10)
    assert not other.is_alive()  # nothing of its own in flight: no wait
    pool.gate.set()
    step.join(10)
    assert not step.is_alive() and len(pool.objects) == 2
    assert worker.counters["commit_waits"] == 1 and worker.counters["late_commits"] == 0
    worker.shutdown()


def test_a_put_that_never_ends_holds_the_answer_only_until_the_timeout() -> None:
    """A hung pool costs one step at most ``commit_timeout_s``: the answer goes out, the
    late commit is counted, and the object is not in the pool (a miss, not a hit)."""
    pool = GatedPool()  # never opened until the end
    worker = async_worker(pool, kv_caches(1))
    worker._commit_timeout_s = 0.2
    worker.save(StorePlan(saves=(SaveSpec("r", (1,), (keys(1),), (None,)),), commit=("r",)))
    assert worker.counters["late_commits"] == 1 and pool.objects == {}
    assert worker.counters["commit_wait_us"] >= 200_000
    # behind the hung put, the next answer does not wait again: one wait per hang
    late = StorePlan(saves=(SaveSpec("s", (2,), (keys(1, "s"),), (None,)),), commit=("s",))
    step = threading.Thread(target=worker.save, args=(late,))
    step.start()
    step.join(10)
    assert not step.is_alive() and worker.counters["late_commits"] == 2
    assert worker.counters["commit_waits"] == 1
    pool.gate.set()  # the pool answers again: both puts end, and the next answer waits
    assert worker.wait_saved(10) and len(pool.objects) == 2
    worker.save(StorePlan(saves=(SaveSpec("t", (3,), (keys(1, "t"),), (None,)),), commit=("t",)))
    assert len(pool.objects) == 3 and worker.counters["late_commits"] == 2
    worker.shutdown()
